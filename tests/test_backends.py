"""Sweep agents on clusters (mwloop/sweep/backends.py): the Slurm array script and the Kubernetes Indexed Job.

The script's command is run by bash to prove its quoting; the script is submitted to the real one-node Slurm
(tests/services) as an array job; the Job passes `kubernetes-validate --strict` offline (Kubernetes
K8S_VERSION), and a planted misspelled field fails it. Bad options are one-line SweepErrors.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from mwloop.sweep import SweepError, backends
from tests.helpers import ROOT

K8S_VERSION = "1.30.0"  # one the installed kubernetes-validate ships schemas for
AWKWARD = ["--sweep=experiments/my sweep.py", "--config=it's:arg", "--workdir=/tmp/$HOME/s dir",
           "--note=`touch pwned` \"q\" $(touch pwned) \\ ; & | *"]


def echo_argv() -> list[str]:
    """A stand-in agent that prints its arguments as JSON."""
    return [sys.executable, "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]


def sbatch(argv=None, **kwargs) -> str:
    args = dict(num_agents=4, parallel=2, job_name="sweep-demo", log_dir="/tmp/sweep/agents", options={})
    args.update(kwargs)
    return backends.render_sbatch(argv or echo_argv(), **args)


def k8s_job(argv=None, **kwargs) -> str:
    args = dict(num_agents=3, parallel=2, name="sweep-demo", image="registry.example.com/mwloop:1", resources={})
    args.update(kwargs)
    return backends.render_k8s_job(argv or [*echo_argv(), "--storage=postgresql://db/sweeps"], **args)


# ---------------------------------------------------------------------------- Slurm

@pytest.mark.slow
def test_sbatch_script_is_one_array_job_with_the_options_passed_through(tmp_path):
    script = sbatch(num_agents=5, parallel=2, options={"gpus": "1", "--cpus-per-task": "4", "mem": "16G",
                                                      "time": "02:00:00", "partition": "gpu", "exclusive": ""},
                    chdir=str(tmp_path))
    directives = [line.split("#")[1].split()[1] for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == ["--job-name=sweep-demo", "--array=0-4%2", "--ntasks=1",
                          "--output=/tmp/sweep/agents/%x-%A_%a.out", "--open-mode=append",
                          "--signal=B:TERM@120", "--gpus=1",
                          "--cpus-per-task=4", "--mem=16G", "--time=02:00:00", "--partition=gpu", "--exclusive"]
    assert script.startswith("#!/bin/bash\n") and f"\ncd {tmp_path}\n" in script
    assert "sbatch THIS_FILE" in script  # says how to submit it
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "#SBATCH --array=0-2%3 " in sbatch(num_agents=3, parallel=8)  # never more at once than agents
    own_signal = sbatch(options={"signal": "B:USR1@600"})
    assert "#SBATCH --signal=B:USR1@600" in own_signal and "--signal=B:TERM" not in own_signal


@pytest.mark.slow
def test_sbatch_script_passes_every_argument_through_the_shell_unchanged(tmp_path):
    script = sbatch(echo_argv() + AWKWARD, chdir=str(tmp_path))
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == AWKWARD
    assert not (tmp_path / "pwned").exists()
    # one flag per line, so the command reads and edits
    assert re.search(r"exec \S+python\S* -c .+ \\\n    '--sweep=experiments/my sweep.py' \\\n", script)


@pytest.mark.parametrize("change, message", [
    (dict(num_agents=0), "--num_agents=0: give the number of agents"),
    (dict(parallel=0), "--parallel=0: give how many agents may run at once"),
    (dict(job_name="my sweep"), "job name 'my sweep'"),
    (dict(options={"cpus_per_task": "4"}), "spelled with dashes: cpus-per-task"),
    (dict(options={"array": "0-99"}), "--array is set by the sweep itself"),
    (dict(options={"output": "x.out"}), "--output is set by the sweep itself"),
    (dict(options={"Time!": "1"}), "'Time!' is not an sbatch long option"),
    (dict(options={"constraint": "a100 or h100"}), "cannot hold spaces or newlines"),
    (dict(log_dir="/tmp/my sweep/agents"), "cannot hold spaces"),
])
def test_bad_sbatch_input_is_one_line(change, message):
    with pytest.raises(SweepError, match=re.escape(message)) as error:
        sbatch(**change)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_sbatch_script_runs_as_an_array_job_on_a_real_slurm(slurm_cluster, tmp_path):
    """3 agents, 2 at a time: each array task runs the command once, with its own SLURM_ARRAY_TASK_ID."""
    marker = [sys.executable, "-c", "import os, sys; open(os.path.join(sys.argv[1], "
              "'task-' + os.environ['SLURM_ARRAY_TASK_ID']), 'w').write(' '.join(sys.argv[2:]))", str(tmp_path)]
    path = tmp_path / "agents.sbatch"
    path.write_text(sbatch(marker + ["--study=it's"], num_agents=3, parallel=2, log_dir=str(tmp_path / "logs"),
                           options={"time": "5"}, chdir=str(tmp_path)))
    job_id = backends.submit_sbatch(str(path), slurm_cluster.env)
    assert job_id.isdigit()
    tasks = slurm_cluster.wait(job_id, timeout_s=120)
    assert sorted(t["ArrayTaskId"] for t in tasks) == ["0", "1", "2"]
    assert {(t["JobState"], t["ExitCode"]) for t in tasks} == {("COMPLETED", "0:0")}
    assert sorted(p.name for p in tmp_path.glob("task-*")) == ["task-0", "task-1", "task-2"]
    assert (tmp_path / "task-2").read_text() == "--study=it's"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [f"sweep-demo-{job_id}_{i}.out" for i in range(3)]


@pytest.mark.slow
def test_submit_sbatch_says_in_one_line_why_slurm_refused(slurm_cluster, tmp_path):
    path = tmp_path / "agents.sbatch"
    path.write_text(sbatch(["true"], options={"partition": "nosuchpartition"}, log_dir=str(tmp_path)))
    with pytest.raises(SweepError, match=r"refused the job: .*[Ii]nvalid partition") as error:
        backends.submit_sbatch(str(path), slurm_cluster.env)
    assert "\n" not in str(error.value)
    with pytest.raises(SweepError, match="sbatch is not on PATH"):
        backends.submit_sbatch(str(path), dict(slurm_cluster.env, PATH="/nonexistent"))


# ---------------------------------------------------------------------------- Kubernetes

def kubernetes_validate(path) -> subprocess.CompletedProcess:
    cli = os.path.join(os.path.dirname(sys.executable), "kubernetes-validate")
    return subprocess.run([cli, "--strict", "-k", K8S_VERSION, str(path)], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_k8s_job_is_an_indexed_job_that_passes_strict_validation(tmp_path):
    text = k8s_job(echo_argv() + AWKWARD + ["--storage=postgresql://u:hunter2@db/sweeps"], num_agents=8, parallel=3,
                   resources={"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "1"}, storage_secret="sweep-db",
                   volume_claim="sweeps", mount_path="/mnt/sweeps")
    path = tmp_path / "agents.yaml"
    path.write_text(text)
    done = kubernetes_validate(path)
    assert done.returncode == 0 and "passed for resource job/sweep-demo" in done.stdout, done.stdout + done.stderr
    assert text.startswith("# ") and "kubectl apply -f THIS_FILE" in text
    job = yaml.safe_load(text)
    spec = job["spec"]
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 8, 3)
    [container] = spec["template"]["spec"]["containers"]
    assert container["image"] == "registry.example.com/mwloop:1"
    # the command is the argv, word for word; the password stays in the Secret, read at run time
    assert container["command"][:3] == echo_argv() and container["command"][3:-1] == [
        *AWKWARD[:3], AWKWARD[3].replace("$(", "$$(")]  # $$: Kubernetes does not expand it
    assert container["command"][-1] == "--storage=$(MWLOOP_STORAGE_URL)" and "hunter2" not in text
    assert container["env"] == [{"name": "MWLOOP_STORAGE_URL",
                                 "valueFrom": {"secretKeyRef": {"name": "sweep-db", "key": "url"}}}]
    limits = {"cpu": "4", "memory": "8Gi", "nvidia.com/gpu": "1"}
    assert container["resources"] == {"requests": limits, "limits": limits}
    assert container["volumeMounts"] == [{"name": "sweep", "mountPath": "/mnt/sweeps"}]
    assert spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "sweeps"}


@pytest.mark.slow
def test_strict_validation_catches_a_misspelled_field(tmp_path):
    """The check above can fail: the same Job with one field misspelled does not pass."""
    job = yaml.safe_load(k8s_job())
    job["spec"]["template"]["spec"]["containers"][0]["comand"] = job["spec"]["template"]["spec"]["containers"][0].pop(
        "command")
    path = tmp_path / "misspelled.yaml"
    path.write_text(yaml.safe_dump(job))
    done = kubernetes_validate(path)
    assert done.returncode != 0 and "comand" in done.stdout + done.stderr


@pytest.mark.parametrize("change, message", [
    (dict(image=""), "--image=''"),
    (dict(name="Sweep_Demo"), "job name 'Sweep_Demo'"),
    (dict(name="x" * 60), "at most 52 characters"),
    (dict(resources={"memory": "8 GB"}), "'8 GB' is not a quantity"),
    (dict(resources={"gpu!": "1"}), "'gpu!' is not a resource name"),
    (dict(num_agents=0), "--num_agents=0"),
    (dict(storage_secret="Bad Name"), "give SECRET[:KEY]"),
    (dict(volume_claim="sweeps"), "give both a volume claim and its mount path"),
    (dict(volume_claim="sweeps", mount_path="mnt"), "an absolute mount path"),
])
def test_bad_k8s_input_is_one_line(change, message):
    with pytest.raises(SweepError, match=re.escape(message)) as error:
        k8s_job(**change)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_sweep_cli_writes_a_valid_agent_job_for_kubernetes(tmp_path):
    """`python -m mwloop.sweep --backend=k8s` creates the study and writes DIR/agents.yaml: a valid Indexed Job
    whose pods run the agent of that study."""
    sweep_dir = tmp_path / "sweep"
    done = subprocess.run(
        [sys.executable, "-m", "mwloop.sweep", "--backend=k8s", "--sweep=experiments/mlp_search.py",
         f"--workdir={sweep_dir}", "--num_agents=6", "--parallel=3", "--image=registry.example.com/mwloop:1",
         "--resource=cpu=2", "--resource=memory=4Gi", "--storage_secret=sweep-db:url", "--volume_claim=sweeps",
         "--mount_path=/mnt/sweeps", "--heartbeat_s=20", "--trial_stall_s=600"],
        env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    path = sweep_dir / "agents.yaml"
    assert done.stdout.strip().splitlines()[-1] == str(path)
    validated = kubernetes_validate(path)
    assert validated.returncode == 0 and "passed for resource job/" in validated.stdout, validated.stdout
    spec = yaml.safe_load(path.read_text())["spec"]
    assert (spec["completions"], spec["parallelism"]) == (6, 3)
    command = spec["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "mwloop.sweep", "agent"] and "--study=mlp_search" in command
    # The agents' own settings reach the pods; the storage URL comes from the Secret, the sweep from the claim.
    assert "--heartbeat_s=20" in command and "--trial_stall_s=600" in command
    container = spec["template"]["spec"]["containers"][0]
    assert [a for a in command if a.startswith("--storage=")] == ["--storage=$(MWLOOP_STORAGE_URL)"]
    assert container["env"][0]["valueFrom"] == {"secretKeyRef": {"name": "sweep-db", "key": "url"}}
    assert container["volumeMounts"] == [{"name": "sweep", "mountPath": "/mnt/sweeps"}]
    assert spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {"claimName": "sweeps"}
