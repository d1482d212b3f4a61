"""A real one-node Slurm cluster (tests/services/slurm.py) runs docs/slurm.sbatch (2-task multi-worker training
through srun) to the end, and sweep studies as array jobs of agents (the slurm backend): a multi-objective grid
with a constraint, and population-based training on the suite's PostgreSQL.

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
import pathlib
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


# A multi-objective grid of three MLP widths, 20 steps each: weights 75 * width + 10, so the constraint removes
# width 64 (4,810) and keeps 8 and 16 (610, 1,210). A grid of enqueued points (get_sweep), so each width runs once
# whichever agent asks for it.
PARETO_SWEEP = """CONFIG = "configs/mlp.py"
OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min"}
CONSTRAINTS = ["cost/params <= 2000"]

def get_sweep(arg=None):
    return [{"model.hidden": (width,), "train.steps": 20, "train.steps_per_loop": 10, "train.log_every_steps": 10,
             "train.eval_every_steps": 20, "train.checkpoint_every_steps": 20} for width in (8, 16, 64)]
"""


def run_agents_job(cluster: slurm.Slurm, script: pathlib.Path, study: str) -> dict[str, str]:
    """Submits a sweep's agents.sbatch as written (2 agents, 2 at a time); returns each array task's log once every
    task ended COMPLETED 0:0."""
    env = job_env(cluster)
    sweep_dir = script.parent
    job_id = backends.submit_sbatch(str(script), env)
    tasks = cluster.wait(job_id, timeout_s=900)
    job_name = f"sweep-{study}".replace("_", "-")
    logs = {t["ArrayTaskId"]: (sweep_dir / "agents" / f"{job_name}-{job_id}_{t['ArrayTaskId']}.out") for t in tasks}
    outputs = {index: path.read_text() if path.exists() else "(no log)" for index, path in logs.items()}
    shown = "\n".join(f"--- agent {index}'s log:\n{output[-3000:]}" for index, output in sorted(outputs.items()))
    assert {(t["JobState"], t["ExitCode"]) for t in tasks} == {("COMPLETED", "0:0")}, shown
    assert sorted(logs) == ["0", "1"]
    assert all(f"agent {index} on study {study}" in output for index, output in outputs.items())
    return outputs


@pytest.mark.slow
def test_sweep_study_runs_as_an_array_job_of_agents(slurm_cluster, tmp_path):
    """The slurm backend end to end with a multi-objective study: `python -m mwloop.sweep --backend=slurm`
    creates the study (SQLite in the sweep directory) and writes agents.sbatch; submitted as is, its 2 array
    tasks are 2 agents that share the study's 3 trials: each trial runs once, the budget is met, not overshot;
    each trial's two objective values are stored, the constraint removes one, and results.md shows the front."""
    import csv

    import optuna

    sweep_file, sweep_dir = tmp_path / "mlp_pareto_slurm.py", tmp_path / "sweep"
    sweep_file.write_text(PARETO_SWEEP)
    written = subprocess.run(
        [sys.executable, "-m", "mwloop.sweep", "--backend=slurm", f"--sweep={sweep_file}", f"--workdir={sweep_dir}",
         "--num_agents=2", "--parallel=2", "--sbatch=time=10"],
        env=job_env(slurm_cluster), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert written.returncode == 0, written.stderr
    script = sweep_dir / "agents.sbatch"
    assert written.stdout.strip().splitlines()[-1] == str(script)
    text = script.read_text()
    assert "#SBATCH --array=0-1%2 " in text and "#SBATCH --time=10" in text and " agent \\\n" in text
    outputs = run_agents_job(slurm_cluster, script, "mlp_pareto_slurm")

    study = optuna.load_study(study_name="mlp_pareto_slurm", storage=f"sqlite:///{sweep_dir}/study.db")
    # Two agents that both saw one point left both ask; the later one is marked surplus and never runs.
    ran = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("mwloop:surplus")]
    assert len(ran) == 3, [(t.number, t.state, t.user_attrs) for t in study.trials]  # the budget, not overshot
    assert {t.state for t in ran} == {optuna.trial.TrialState.COMPLETE}
    # each trial started by exactly one agent, and both agents ran trials
    started = {index: re.findall(r"trial (\d+) started", output) for index, output in outputs.items()}
    assert sorted(int(n) for numbers in started.values() for n in numbers) == sorted(t.number for t in ran), started
    assert all(started.values()), started
    # Each trial's objectives as Optuna holds them: accuracy, then the weight count of its width.
    width = {t.number: json.loads(t.user_attrs["mwloop:point"])["model.hidden"][0] for t in ran}
    assert sorted(width.values()) == [8, 16, 64]
    assert all(len(t.values) == 2 and 0 < t.values[0] <= 1 and t.values[1] == 75 * width[t.number] + 10
               for t in ran), [(t.values, t.params) for t in ran]
    # The constraint removes width 64 (never on the front) and keeps the others; the smallest model is on it.
    with open(sweep_dir / "results.csv", newline="") as f:
        rows = {width[int(r["trial"])]: r for r in csv.DictReader(f)}
    assert {w: r["feasible"] for w, r in rows.items()} == {8: "True", 16: "True", 64: "False"}
    front = {width[t.number] for t in study.best_trials}
    assert 8 in front and 64 not in front and {w for w, r in rows.items() if r["pareto"] == "True"} == front
    markdown = (sweep_dir / "results.md").read_text()
    assert f"Pareto front of eval/accuracy (max), cost/params (min): {len(front)} trial(s)" in markdown


# Population-based training at its smallest: 2 members, 2 intervals of 10 MLP steps; the worse member of
# interval 0 copies the better one's checkpoint (QUANTILE 0.5 of 2: one member) and perturbs its rate.
PBT_SWEEP = """CONFIG = "configs/mlp.py"
ALGORITHM = "pbt"
POPULATION = 2
INTERVAL_STEPS = 10
QUANTILE = 0.5
PERTURB = {"optimizer.learning_rate": (0.8, 1.25)}

def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 0.01, 0.5, log=True)
    return {"train.steps": 20, "train.steps_per_loop": 10, "train.log_every_steps": 10, "train.eval_every_steps": 0,
            "train.checkpoint_every_steps": 10, "export": False}
"""


@pytest.mark.slow
def test_pbt_members_run_as_an_array_job_of_agents_on_postgresql(slurm_cluster, postgres_url, tmp_path):
    """A PBT sweep with --backend=slurm on the real PostgreSQL: 2 agents (array tasks) share the population's
    segments. Exactly the planned segments, each trained once by one agent; each interval decided once (one
    lineage per member per interval, one exploit per later interval); the winner's reproduce command printed."""
    import optuna

    from mwloop.sweep import local, pbt_runner
    from mwloop.sweep import study as studies

    sweep_file, sweep_dir, name = tmp_path / "mlp_pbt_slurm.py", tmp_path / "sweep", "mlp_pbt_slurm"
    sweep_file.write_text(PBT_SWEEP)
    # Created here (the command line's own path is the story above's): one TensorFlow start-up fewer.
    created = local.create_sweep(sweep_spec=str(sweep_file), sweep_dir=str(sweep_dir), study_name=name,
                                 storage_url=postgres_url, seed=1)
    script = local.launch_agents(created, backend="slurm", num_agents=2, parallel=2, num_workers=1,
                                 options={"time": "10"})
    assert script == str(sweep_dir / "agents.sbatch")
    outputs = run_agents_job(slurm_cluster, sweep_dir / "agents.sbatch", name)

    trials = optuna.load_study(study_name=name, storage=postgres_url).get_trials(deepcopy=False)
    shown = studies.shown(trials)
    lineage = {(t.user_attrs[pbt_runner.LINEAGE]["member"], t.user_attrs[pbt_runner.LINEAGE]["interval"]): t
               for t in shown}
    # Exactly the planned segments, all complete: 2 members x 2 intervals, one trial each.
    assert sorted(lineage) == [(0, 0), (0, 1), (1, 0), (1, 1)] and len(shown) == 4, \
        [(t.number, t.state, t.user_attrs) for t in trials]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in shown) and len(studies.counted(trials)) == 4
    # Decided once: a segment two agents enqueued in a race is dropped as surplus with the same plan (the
    # decision is a function of the stored scores), never run.
    for t in trials:
        if t.user_attrs.get(studies.SURPLUS):
            kept = lineage[t.user_attrs[pbt_runner.LINEAGE]["member"], t.user_attrs[pbt_runner.LINEAGE]["interval"]]
            assert t.user_attrs[pbt_runner.LINEAGE] == kept.user_attrs[pbt_runner.LINEAGE]
    second = [lineage[m, 1].user_attrs[pbt_runner.LINEAGE] for m in (0, 1)]
    scores = {m: lineage[m, 0].value for m in (0, 1)}
    worst, best = sorted(scores, key=lambda m: (scores[m], -m))
    assert [s["exploit"] for s in second].count(True) == 1 and second[worst]["parent"] == [best, 0]
    assert second[best]["parent"] == [best, 0] and not second[best]["exploit"]
    # Each segment trained once, by one agent, and both agents trained segments.
    started = {index: [int(n) for n in re.findall(r"trial (\d+) started", output)] for index, output in outputs.items()}
    assert sorted(n for numbers in started.values() for n in numbers) == sorted(t.number for t in shown), started
    assert all(started.values()), started
    logs = glob.glob(str(sweep_dir / "m*" / "k*" / "log.txt"))
    assert len(logs) == 4 and all(open(p).read().count("\n=== ") == 0 for p in logs)
    assert "warm start of the whole state from" in (sweep_dir / "m0" / "k1" / "log.txt").read_text()
    # The winner's schedule, retrained from scratch: one mwloop.main per interval.
    winner = [line for output in outputs.values() for line in output.splitlines() if "PBT winner: member m" in line]
    assert winner and all(line.count(" && ") == 1 and "--config.init_checkpoint=" in line for line in winner), \
        winner
