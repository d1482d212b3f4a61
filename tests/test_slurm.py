"""A real one-node Slurm cluster (tests/services/slurm.py) runs docs/slurm.sbatch: 2-task multi-worker training
through srun, to the end.

The cluster is Debian's slurm-wlm + munge, brought up by the `slurm_cluster` fixture; if a daemon cannot start,
every test here fails with one line naming it. The batch file is the one users submit, unchanged: sbatch's
own command-line options override its #SBATCH lines (one node, two tasks, one CPU each) and its arguments go
to mwloop.main (a short MLP run).
"""

from __future__ import annotations

import glob
import json
import os
import sys

from tests.helpers import ROOT, read_metrics
from tests.services import slurm

SBATCH = os.path.join(ROOT, "docs", "slurm.sbatch")


def job_env(cluster: slurm.Slurm, **extra: str) -> dict[str, str]:
    """The submitting shell's environment for a job that runs this checkout's mwloop with this Python.

    sbatch exports it to the job (and srun to every task): `python` is the test's interpreter, and
    GCE_METADATA_IP keeps TensorFlow's preemption handler from probing the network."""
    path = os.pathsep.join([os.path.dirname(sys.executable), cluster.env.get("PATH", os.defpath)])
    return dict(cluster.env, PATH=path, PYTHONPATH=ROOT, GCE_METADATA_IP="127.0.0.1:9", **extra)


def test_cluster_has_one_idle_node(slurm_cluster):
    done = slurm_cluster.run("sinfo", "--noheader", "--format=%P %D %T %c")
    assert done.returncode == 0, done.stderr
    partition, nodes, state, cpus = done.stdout.split()
    assert (partition, nodes, state) == (f"{slurm.PARTITION}*", "1", "idle") and int(cpus) >= 2


def test_docs_slurm_sbatch_trains_two_workers_to_the_end(slurm_cluster, tmp_path):
    workdir = tmp_path / "run"
    env = job_env(slurm_cluster, CONFIG="configs/mlp.py", WORKDIR=str(workdir))
    submitted = slurm_cluster.run(
        "sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10",
        f"--output={tmp_path}/%x-%j.out", SBATCH,
        "--config.train.steps=40", "--config.train.eval_every_steps=20", "--config.train.checkpoint_every_steps=20",
        "--config.train.log_every_steps=20", env=env, cwd=ROOT)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    [job] = slurm_cluster.wait(job_id)
    outputs = glob.glob(str(tmp_path / "*.out"))
    output = open(outputs[0]).read() if outputs else "(no job output file)"
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert outputs == [str(tmp_path / f"mwloop-resnet-{job_id}.out")]
    assert (job["NumTasks"], job["NumNodes"]) == ("2", "1")

    # Two workers, one cluster (SlurmClusterResolver): the chief (task 0) wrote the run, both trained 40 steps.
    assert "CollectiveAllReduceStrategy: 2 replicas, 2 workers, chief=True" in output
    assert "CollectiveAllReduceStrategy: 2 replicas, 2 workers, chief=False" in output
    assert output.count("training done at step 40") == 2
    config = json.loads((workdir / "config.json").read_text())
    assert config["train"]["steps"] == 40 and config["name"] == "mlp"
    events = read_metrics(str(workdir))
    assert [e["step"] for e in events if e["split"] == "train"] == [20, 40]
    evals = [e for e in events if e["split"] == "eval"]
    assert [e["step"] for e in evals] == [20, 40]
    assert evals[-1]["accuracy"] > 0.5  # 40 steps of the digits MLP: well above chance (0.1)
    checkpoints = sorted(os.path.basename(p) for p in glob.glob(str(workdir / "checkpoints" / "ckpt-*.index")))
    assert checkpoints == ["ckpt-20.index", "ckpt-40.index"]
    assert (workdir / "export" / "saved_model.pb").exists()
