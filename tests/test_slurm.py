"""A real one-node Slurm cluster (tests/services/slurm.py) runs docs/slurm.sbatch (2-task multi-worker training
through srun) to the end, and a sweep study as an array job of agents (the slurm backend).

The cluster is Debian's slurm-wlm + munge, brought up by the `slurm_cluster` fixture; if a daemon cannot start,
every test that uses it fails with one line naming it. The batch file is the one users submit, unchanged:
sbatch's own command-line options override its #SBATCH lines (one node, two tasks, one CPU each) and its
arguments go to mwloop.main (a short MLP run). One fast test runs it without Slurm (a stand-in srun) to pin
which interpreter its tasks run.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest

from mwloop.sweep import backends
from tests.helpers import ROOT, read_metrics
from tests.services import slurm

SBATCH = os.path.join(ROOT, "docs", "slurm.sbatch")


def job_env(cluster: slurm.Slurm, **extra: str) -> dict[str, str]:
    """The submitting shell's environment for a job that runs this checkout's mwloop with this Python.

    sbatch exports it to the job (and srun to every task): PYTHON (docs/slurm.sbatch) and `python` (a sweep's
    agents.sbatch) are the test's interpreter, and GCE_METADATA_IP keeps TensorFlow's preemption handler from
    probing the network."""
    path = os.pathsep.join([os.path.dirname(sys.executable), cluster.env.get("PATH", os.defpath)])
    return dict(cluster.env, PATH=path, PYTHONPATH=ROOT, PYTHON=sys.executable, GCE_METADATA_IP="127.0.0.1:9",
                **extra)


def run_sbatch_script(tmp_path, cwd, **env: str) -> subprocess.CompletedProcess:
    """docs/slurm.sbatch run by bash as a job would run it (in the directory sbatch was run in), with an `srun`
    that prints the command it was given, one argument a line: what every task would run. No Slurm needed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    srun.chmod(0o755)
    env = {"PATH": os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]), "HOME": str(tmp_path), **env}
    return subprocess.run(["bash", SBATCH, "--config.train.steps=400"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


def test_docs_slurm_sbatch_runs_the_projects_venv_or_PYTHON(tmp_path):
    """Every task runs .venv/bin/python of the directory sbatch was run in (the README's commands), not the
    nodes' `python`; PYTHON names another; no such interpreter: one error line, exit 2, before srun."""
    checkout = tmp_path / "checkout"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, checkout / ".venv" / "bin" / "python")
    ran = run_sbatch_script(tmp_path, checkout)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["--kill-on-bad-exit=1", ".venv/bin/python", "-m", "mwloop.main",
                                       "--config=configs/resnet.py", f"--workdir={tmp_path}/runs/resnet-digits",
                                       "--config.train.steps=400"]
    ran = run_sbatch_script(tmp_path, checkout, PYTHON=sys.executable, CONFIG="configs/mlp.py", WORKDIR="/w")
    assert ran.stdout.splitlines()[1:6] == [sys.executable, "-m", "mwloop.main", "--config=configs/mlp.py",
                                            "--workdir=/w"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ran = run_sbatch_script(tmp_path, elsewhere)
    assert (ran.returncode, ran.stdout) == (2, "")
    assert ran.stderr.splitlines() == [
        f"error: no Python at PYTHON=.venv/bin/python in {elsewhere}: submit from the mwloop checkout that holds "
        ".venv (python3 -m venv .venv && .venv/bin/pip install -e .), or set PYTHON=/path/to/bin/python"]
    assert run_sbatch_script(tmp_path, elsewhere, PYTHON="no-such-python").returncode == 2


@pytest.mark.slow  # a real one-node Slurm (slurm_cluster), as the tests below
def test_cluster_has_one_idle_node(slurm_cluster):
    done = slurm_cluster.run("sinfo", "--noheader", "--format=%P %D %T %c")
    assert done.returncode == 0, done.stderr
    partition, nodes, state, cpus = done.stdout.split()
    assert (partition, nodes, state) == (f"{slurm.PARTITION}*", "1", "idle") and int(cpus) >= 2


@pytest.mark.slow
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
    assert (workdir / "export" / "40" / "saved_model.pb").exists()  # TF Serving's layout: a version per step


@pytest.mark.slow
def test_sweep_study_runs_as_an_array_job_of_agents(slurm_cluster, tmp_path):
    """The slurm backend end to end: `python -m mwloop.sweep --backend=slurm` creates the study (SQLite in the
    sweep directory) and writes agents.sbatch; submitted as is, its 2 array tasks are 2 agents that share the
    study's 3 trials: each trial runs once, the budget is met, not overshot."""
    import optuna

    sweep_dir = tmp_path / "sweep"
    env = job_env(slurm_cluster)
    written = subprocess.run(
        [sys.executable, "-m", "mwloop.sweep", "--backend=slurm", "--sweep=experiments/mlp_search.py",
         f"--workdir={sweep_dir}", "--n_trials=3", "--num_agents=2", "--parallel=2", "--sbatch=time=10"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert written.returncode == 0, written.stderr
    script = sweep_dir / "agents.sbatch"
    assert written.stdout.strip().splitlines()[-1] == str(script)
    text = script.read_text()
    assert "#SBATCH --array=0-1%2 " in text and "#SBATCH --time=10" in text and " agent \\\n" in text

    job_id = backends.submit_sbatch(str(script), env)
    tasks = slurm_cluster.wait(job_id, timeout_s=900)
    logs = {t["ArrayTaskId"]: (sweep_dir / "agents" / f"sweep-mlp-search-{job_id}_{t['ArrayTaskId']}.out")
            for t in tasks}
    outputs = {index: path.read_text() if path.exists() else "(no log)" for index, path in logs.items()}
    shown = "\n".join(f"--- agent {index}'s log:\n{output[-3000:]}" for index, output in sorted(outputs.items()))
    assert {(t["JobState"], t["ExitCode"]) for t in tasks} == {("COMPLETED", "0:0")}, shown
    assert sorted(logs) == ["0", "1"]

    study = optuna.load_study(study_name="mlp_search", storage=f"sqlite:///{sweep_dir}/study.db")
    # Two agents that both saw one trial left both ask; the later one is marked surplus and never runs.
    ran = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("mwloop:surplus")]
    assert len(ran) == 3, [(t.number, t.state, t.user_attrs) for t in study.trials]  # the budget, not overshot
    assert {t.state for t in ran} <= {optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED}
    assert any(t.state == optuna.trial.TrialState.COMPLETE for t in ran)
    # each trial started by exactly one agent, and both agents ran trials
    started = {index: re.findall(r"trial (\d+) started", output) for index, output in outputs.items()}
    assert sorted(int(n) for numbers in started.values() for n in numbers) == sorted(t.number for t in ran), started
    assert all(started.values()), started
    assert all(f"agent {index} on study mlp_search" in output for index, output in outputs.items())
    assert (sweep_dir / "results.md").exists()
