"""Sweeps with several objectives and constraints (issue 46 part 1), in-process: the sweep file's OBJECTIVES and
CONSTRAINTS and their one-line refusals, what a trial tells Optuna (Trial.set_constraint, values), the Pareto
front in results.md, results.csv and results.png, and one local sweep of a search whose trials are
tests/fake_trainer.py (an accuracy and a cost that both grow with the learning rate)."""

from __future__ import annotations

import csv
import json
import os
import sys
import textwrap

import optuna
import pytest
from optuna.trial import TrialState

from helpers import ROOT
from mwloop.sweep import SweepError, local, objectives, report, runner, space
from mwloop.sweep import study as studies

HEAD = 'CONFIG = "configs/mlp.py"\n'
SPACE = """
def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 0.05, 0.5, log=True)
    return {"train.steps": 10}
"""


def _sweep_file(tmp_path, body: str, name: str = "s.py") -> str:
    path = tmp_path / name
    path.write_text(HEAD + textwrap.dedent(body) + SPACE)
    return str(path)


def test_objectives_and_constraints_are_read_with_pruning_off(tmp_path):
    sweep = space.load_sweep(_sweep_file(tmp_path, """
        OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min"}
        CONSTRAINTS = ["cost/params <= 2e6", "cost/examples_per_sec >= 100"]
    """))
    assert sweep.objectives == (("eval/accuracy", "max"), ("cost/params", "min")) and sweep.multi
    assert (sweep.metric, sweep.mode, sweep.pruner) == ("eval/accuracy", "max", "none")
    assert objectives.parse_constraint(sweep.constraints[0]) == ("cost/params", "<=", 2e6)
    one = space.load_sweep(_sweep_file(tmp_path, 'OBJECTIVES = {"eval/loss": "min"}\n', "one.py"))
    assert not one.multi and (one.metric, one.mode, one.pruner) == ("eval/loss", "min", "median")


@pytest.mark.parametrize("body, message", [
    ('OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min"}\nPRUNER = "median"\n',
     r"PRUNER 'median' with 2 OBJECTIVES: Optuna's pruners judge one objective .*use PRUNER = 'none'"),
    ('OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min"}\nSAMPLER = "cmaes"\n',
     r"SAMPLER 'cmaes' optimises one objective, not 2; use tpe, nsga2 or random"),
    ('OBJECTIVES = {"eval/accuracy": "max"}\nMETRIC = "eval/loss"\n', r"sets both OBJECTIVES and METRIC/MODE"),
    ('OBJECTIVES = {"eval/accuracy": "up"}\n', r"'eval/accuracy': 'up': each is a <split>/<metric> with max or min"),
    ('CONSTRAINTS = ["cost/params < 2e6"]\n', r"CONSTRAINTS: 'cost/params < 2e6' is not '<split>/<metric> <= number'"),
    ('CONSTRAINTS = "cost/params <= 1"\n', r"CONSTRAINTS must be a list of strings"),
])
def test_a_sweep_that_cannot_work_is_one_line_before_anything_runs(tmp_path, body, message):
    with pytest.raises(SweepError, match=message) as raised:
        local.create_sweep(sweep_spec=_sweep_file(tmp_path, body), sweep_dir=str(tmp_path / "sweep"))
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "sweep").exists()


def test_a_trial_tells_its_values_and_constraints_and_the_front_keeps_feasible_undominated_trials():
    study = optuna.create_study(directions=["maximize", "minimize"])
    goals, limit = (("eval/accuracy", "max"), ("cost/params", "min")), ["cost/params <= 5000"]
    finals = [{"eval/accuracy": 0.9, "cost/params": 4000}, {"eval/accuracy": 0.8, "cost/params": 3000},
              {"eval/accuracy": 0.7, "cost/params": 3500},  # dominated by the second
              {"eval/accuracy": 0.99, "cost/params": 9000}]  # the best accuracy, infeasible
    for final in finals:
        told = objectives.outcome(goals, limit, final)
        summary = objectives.tell(study, study.ask(), goals, *told)
    assert summary == "eval/accuracy 0.99, cost/params 9000 (infeasible: cost/params <= 5000)"
    trials = studies.all_trials(study)
    assert [t.constraints for t in trials][3] == {"cost/params <= 5000": 4000.0}
    assert sorted(t.number for t in studies.pareto_front(trials, ["maximize", "minimize"])) == [0, 1]
    assert sorted(t.number for t in study.best_trials) == [0, 1]  # what Optuna itself calls the front
    assert objectives.outcome(goals, limit, {"eval/accuracy": 0.5}) == \
        "the run wrote no cost/params to metrics.jsonl (it wrote: eval/accuracy)"
    assert objectives.outcome(goals, limit, {"eval/accuracy": float("nan"), "cost/params": 1}) == \
        "the run ended with eval/accuracy = nan"


def test_a_study_stored_before_objectives_existed_still_loads():
    settings = studies.Settings(kind="search", sweep="s.py", config="configs/mlp.py", metric="eval/accuracy",
                                mode="max", n_trials=2, sampler="tpe", sampler_options={}, pruner="median",
                                pruner_options={}, prune_by="step", seed=0)
    study = optuna.create_study()
    # What mwloop stored before OBJECTIVES and CONSTRAINTS existed.
    for key, value in studies.settings_attrs(settings).items():
        if key not in (studies.ATTR + "objectives", studies.ATTR + "constraints"):
            study.set_user_attr(key, value)
    loaded = studies.stored_settings(study)
    assert loaded == settings and loaded.all_objectives == (("eval/accuracy", "max"),) and not loaded.multi


def _fake_command(config_spec, workdir, override_flags, num_workers=1):
    return [sys.executable, os.path.join(ROOT, "tests", "fake_trainer.py"), f"--workdir={workdir}", *override_flags]


def test_the_agent_tells_each_trials_objectives_and_results_show_the_front(tmp_path):
    """The agent's own path, without processes: a trial prepared, its metrics.jsonl written as a run writes it,
    followed and told; then results.md/csv/png from the study."""
    from mwloop.sweep import agent as agents
    from mwloop.sweep import plan
    from mwloop.sweep.results import Results

    sweep = space.load_sweep(_sweep_file(tmp_path, """
        OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min"}
        CONSTRAINTS = ["cost/params <= 2000"]
        N_TRIALS = 4
    """))
    created = local.create_sweep(sweep_spec=sweep.spec, sweep_dir=str(tmp_path / "sweep"), seed=0)
    study, settings = studies.load(created.storage, created.name, storage_url=created.storage_url, sweep=sweep)
    agent = agents.Agent(sweep, settings, created.sweep_dir, "configs/mlp.py", plan.base_config("configs/mlp.py"))
    for accuracy, params in ((0.9, 1500.0), (0.8, 1000.0), (0.7, 1200.0), (0.95, 2500.0)):
        run = agents.prepare_trial(agent, study, study.ask())
        assert run.command[-1] == "--config.record_cost=true"  # every trial records what it costs
        os.makedirs(run.workdir)
        with open(os.path.join(run.workdir, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"step": 0, "split": "cost", "params": params}) + "\n")
            agents.report_new(run)  # followed while it trains: nothing reported to a multi-objective study
            f.write(json.dumps({"step": 10, "split": "eval", "accuracy": accuracy}) + "\n")
        agents.report_new(run)  # once more when the run has exited, as run_trial does
        assert agents.tell_trial(agent, study, run, 0, 1.0, 0.0) == TrialState.COMPLETE
    trials = studies.all_trials(study)
    assert [t.values for t in trials] == [[0.9, 1500.0], [0.8, 1000.0], [0.7, 1200.0], [0.95, 2500.0]]
    assert [t.constraints["cost/params <= 2000"] for t in trials] == [-500.0, -1000.0, -800.0, 500.0]
    assert all(not t.intermediate_values for t in trials)
    assert {t.number for t in study.best_trials} == {0, 1}  # trial 2 dominated by 1, trial 3 infeasible

    results = Results(created.sweep_dir, settings, "Sweep s.py")
    ranked = results.write(trials, final=True)
    assert [(r.number, r.pareto, r.feasible) for r in ranked] == [(0, True, True), (1, True, True),
                                                                   (2, False, True), (3, False, False)]
    sweep_dir = tmp_path / "sweep"
    with open(sweep_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["trial"], r["pareto"], r["feasible"]) for r in rows] == [
        ("0", "True", "True"), ("1", "True", "True"), ("2", "False", "True"), ("3", "False", "False")]
    markdown = (sweep_dir / "results.md").read_text()
    assert "Pareto front of eval/accuracy (max), cost/params (min): 2 trial(s)" in markdown
    assert "| Pareto | feasible |" in markdown and "**eval/accuracy** | **cost/params**" in markdown
    assert markdown.count("# trial ") == 2  # each front trial's reproduce command
    assert (sweep_dir / "results.png").stat().st_size > 0


@pytest.mark.slow  # a PostgreSQL server of its own and trial processes (tests/fake_trainer.py, no TensorFlow)
def test_a_search_with_two_objectives_and_a_constraint_on_postgresql(tmp_path, monkeypatch):
    from tests.services import postgres

    server = postgres.start()
    try:
        _search_story(tmp_path, monkeypatch, server.url)
    finally:
        server.stop()


def _search_story(tmp_path, monkeypatch, storage_url: str | None = None) -> None:
    """Five trials of fake_trainer, two agents: the study's values and constraints, results.csv/md/png."""
    monkeypatch.setattr(runner, "command", _fake_command)
    monkeypatch.setenv("FAKE_TRAINER_COST", "1")
    sweep_file = _sweep_file(tmp_path, """
        OBJECTIVES = {"eval/accuracy": "max", "cost/params": "min"}
        CONSTRAINTS = ["cost/params <= 2000"]
        N_TRIALS = 5
    """)
    sweep_dir = tmp_path / "sweep"
    assert local.run_sweep(sweep_spec=sweep_file, sweep_dir=str(sweep_dir), seed=0, parallel=2,
                           storage_url=storage_url) == 0
    study = optuna.load_study(study_name="s", storage=storage_url or f"sqlite:///{sweep_dir}/study.db")
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5 and all(len(t.values) == 2 for t in trials)
    # fake_trainer: accuracy = rate, params = rate * 10000: every feasible trial is on the front.
    feasible = {t.number for t in trials if t.params["optimizer.learning_rate"] <= 0.2}
    assert 0 < len(feasible) < 5, "the constraint removes some trials and keeps some (seed 0)"
    assert {t.number for t in study.best_trials} == feasible
    with open(sweep_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {int(r["trial"]) for r in rows if r["pareto"] == "True"} == feasible
    assert {r["feasible"] for r in rows if int(r["trial"]) not in feasible} == {"False"}
    # Front first, infeasible last.
    assert [r["pareto"] for r in rows] == ["True"] * len(feasible) + ["False"] * (5 - len(feasible))
    markdown = (sweep_dir / "results.md").read_text()
    assert f"Pareto front of eval/accuracy (max), cost/params (min): {len(feasible)} trial(s)" in markdown
    assert "| Pareto | feasible |" in markdown and "**eval/accuracy** | **cost/params**" in markdown
    assert markdown.count("# trial ") == len(feasible)  # each front trial's reproduce command
    assert (sweep_dir / "results.png").stat().st_size > 0


def test_a_grid_with_two_objectives_plots_its_front(tmp_path):
    rows = [report.PointResult(f"t{i}", "", {"lr": lr}, "complete", number=i, pareto=i < 2, feasible=i != 2,
                               events=[{"step": 1, "split": "eval", "accuracy": lr},
                                       {"step": 1, "split": "cost", "params": 1000 * lr}])
            for i, lr in enumerate((0.1, 0.2, 0.3))]
    from mwloop.sweep import plots
    plots.write_plot(str(tmp_path / "results.png"), rows, ["lr"], {"lr": "lr"}, metric="eval/accuracy",
                     objectives=[("eval/accuracy", "max"), ("cost/params", "min")])
    assert (tmp_path / "results.png").stat().st_size > 0


def test_nsga2_samples_a_constrained_multi_objective_study():
    settings = studies.Settings(kind="search", sweep="s.py", config="configs/mlp.py", metric="eval/accuracy",
                                mode="max", n_trials=6, sampler="nsga2", sampler_options={"population_size": 2},
                                pruner="none", pruner_options={}, prune_by="step", seed=0,
                                objectives=(("eval/accuracy", "max"), ("cost/params", "min")),
                                constraints=("cost/params <= 50",))
    sampler = studies.make_sampler(settings, None)
    assert isinstance(sampler, optuna.samplers.NSGAIISampler)
    study = optuna.create_study(directions=settings.directions, sampler=sampler)
    for _ in range(6):  # three generations of two
        trial = study.ask()
        width = trial.suggest_int("_width", 1, 100)
        final = {"eval/accuracy": width / 100, "cost/params": float(width)}
        objectives.tell(study, trial, settings.all_objectives,
                        *objectives.outcome(settings.all_objectives, settings.constraints, final))
    assert study.best_trials and all(t.values[1] <= 50 for t in study.best_trials)


def test_a_trials_directory_with_what_the_agent_adds_is_its_own_run(tmp_path):
    """A retry or a rerun finds the trial's config.json with record_cost set by the agent: the same run."""
    from mwloop.sweep import plan

    (point,) = plan.plan("configs/mlp.py", [{"optimizer.learning_rate": 0.2}])
    ran = plan.parse_config("configs/mlp.py", [*point.flags, *plan.trial_flags(point.config)])
    assert ran.record_cost and not point.config.record_cost
    (tmp_path / "config.json").write_text(ran.to_json_best_effort())
    plan.check_workdir(str(tmp_path), point.config)
    (other,) = plan.plan("configs/mlp.py", [{"optimizer.learning_rate": 0.3}])
    with pytest.raises(SweepError, match=r"optimizer.learning_rate: 0.2 -> 0.3"):
        plan.check_workdir(str(tmp_path), other.config)


def test_the_shipped_resnet_pareto_grid_checks_against_its_config():
    """experiments/resnet_pareto.py (BENCHMARKS.md): three objectives, one weight bound, and a grid of 12 points
    that are valid digits ResNet configs (each stage doubles the first width). Its constraint's effect (which
    models it removes) is the run's table, not rebuilt here: 12 Keras models cost seconds."""
    sweep = space.load_sweep(os.path.join(ROOT, "experiments", "resnet_pareto.py"))
    assert sweep.multi and sweep.sampler == "grid" and sweep.pruner == "none"
    assert [name for name, _ in sweep.objectives] == ["eval/accuracy", "cost/params", "cost/examples_per_sec"]
    assert objectives.parse_constraint(sweep.constraints[0]) == ("cost/params", "<=", 250000)
    grid = space.grid_space(sweep)
    assert len(grid["_width"]) * len(grid["_blocks"]) == 12
    checked = space.check(sweep, os.path.join(ROOT, sweep.config))
    assert checked and {o["model.widths"] for o in checked} <= {(w, 2 * w, 4 * w) for w in grid["_width"]}
