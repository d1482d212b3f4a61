"""The multi-machine elastic agent's deployment forms in docs/ (split from tests/test_agent.py):
docs/elastic_agents.yaml (the Kubernetes form) checked offline with kubernetes-validate --strict, like
tests/test_k8s.py's manifests, and docs/elastic_agents.sbatch run to the end on the tests' one-node Slurm
with a real etcd.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

# --- docs/elastic_agents.yaml: the agents as a Kubernetes Indexed Job with an etcd Service ---

MANIFEST = os.path.join(ROOT, "docs", "elastic_agents.yaml")


def test_the_kubernetes_manifest_of_agents_is_valid_and_consistent():
    import kubernetes_validate
    import yaml

    from tests.test_k8s import K8S_VERSION
    docs = [doc for doc in yaml.safe_load_all(open(MANIFEST)) if doc]
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "Deployment", "Service", "Job"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    claim, etcd, service, job = docs
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    [agent] = spec["template"]["spec"]["containers"]
    command = agent["command"]
    assert command[:3] == ["python", "-m", "mwloop.launch"]
    flags = dict(arg[2:].split("=", 1) for arg in command[3:command.index("--")])
    port = service["spec"]["ports"][0]["port"]
    assert flags["rdzv"] == f"etcd://{service['metadata']['name']}:{port}/{job['metadata']['name']}"
    assert service["spec"]["selector"] == etcd["spec"]["template"]["metadata"]["labels"]
    low, high = map(int, flags["num_workers"].split(":"))
    assert high == spec["parallelism"] * int(flags["workers_per_host"]) and low <= high
    assert {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in agent["env"]} == {
        "POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    assert flags["address"] == "$(POD_IP)" and flags["host_id"] == "$(POD_NAME)"
    assert float(flags["grace_s"]) < spec["template"]["spec"]["terminationGracePeriodSeconds"]
    [volume] = spec["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    [fail] = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert fail["onExitCodes"] == {"containerName": agent["name"], "operator": "In", "values": [2]}


def test_a_misspelled_field_fails_the_manifest_check():
    import kubernetes_validate
    import yaml

    from tests.test_k8s import K8S_VERSION
    job = [doc for doc in yaml.safe_load_all(open(MANIFEST)) if doc][-1]
    job["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = \
        job["spec"]["template"]["spec"]["containers"][0].pop("volumeMounts")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


@pytest.mark.slow
def test_kubernetes_validate_cli_passes_the_manifest_of_agents():
    cli = os.path.join(os.path.dirname(sys.executable), "kubernetes-validate")
    from tests.test_k8s import K8S_VERSION
    done = subprocess.run([cli, "--strict", "-k", K8S_VERSION, MANIFEST], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed") == 4, done.stdout


# --- docs/elastic_agents.sbatch: one agent per Slurm task through srun ---

@pytest.mark.slow
def test_docs_elastic_agents_sbatch_trains_with_two_agents_to_the_end(slurm_cluster, etcd_server, tmp_path):
    from tests.test_slurm import job_env
    workdir = tmp_path / "run"  # ADDRESS left out: the batch file's default (`hostname --ip-address`) is this host
    # As written: only PYTHON names this checkout's interpreter; a bare `python` on the nodes' PATH has no mwloop.
    env = {**job_env(slurm_cluster, RDZV=f"etcd://{etcd_server.host}:{etcd_server.port}", CONFIG="configs/mlp.py",
                     WORKDIR=str(workdir), AGENT_FLAGS="--rdzv_ttl_s=2 --wait_for_min_s=60"),
           "PATH": slurm_cluster.env.get("PATH", os.defpath)}
    submitted = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
        f"--output={tmp_path}/%x-%j.out", os.path.join(ROOT, "docs", "elastic_agents.sbatch"),
        "--config.train.steps=40", "--config.train.eval_every_steps=20", "--config.train.checkpoint_every_steps=20",
        "--config.train.log_every_steps=20", env=env, cwd=ROOT)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    [job] = slurm_cluster.wait(job_id)
    output = (tmp_path / f"mwloop-elastic-{job_id}.out").read_text()
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert re.search(r"round 0: 2 workers on \S+-[01], \S+-[01]", output), output[-4000:]
    assert f"joined job {job_id} at etcd://" in output
    assert output.count("training done at step 40") == 2
    assert [e["step"] for e in files_metrics(workdir) if e["split"] == "train"] == [20, 40]


def files_metrics(workdir) -> list[dict]:
    from mwloop.artifacts import files
    return files.read_metrics(str(workdir))

