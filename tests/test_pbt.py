"""PBT's decisions (mwloop/sweep/pbt.py, docs/pbt.md), in-process: who exploits whom, perturbations, the keys
that may be perturbed."""

from __future__ import annotations

import pytest
from optuna.trial import TrialState

from mwloop.sweep import SweepError, pbt


def test_the_bottom_quantile_copies_the_top_and_the_rest_continue():
    scores = {0: 0.5, 1: 0.9, 2: 0.1, 3: 0.7, 4: 0.3, 5: 0.8, 6: 0.2, 7: 0.6}
    parents = pbt.decide(scores, mode="max", quantile=0.25, seed=pbt.seed_for(0, 3))
    exploiting = {m: p for m, p in parents.items() if m != p}
    assert set(exploiting) == {2, 6} and set(exploiting.values()) <= {1, 5}
    assert parents == pbt.decide(scores, mode="max", quantile=0.25, seed=pbt.seed_for(0, 3))  # decided again: same
    losses = pbt.decide(scores, mode="min", quantile=0.25, seed=1)
    assert {m for m, p in losses.items() if m != p} == {1, 5}
    assert pbt.decide(scores, mode="max", quantile=0.0, seed=1) == {m: m for m in scores}
    assert pbt.decide({0: 1.0}, mode="max", quantile=0.5, seed=1) == {0: 0}
    with pytest.raises(SweepError, match=r"QUANTILE must be in \[0, 0.5\], got 0.75"):
        pbt.decide(scores, mode="max", quantile=0.75, seed=1)


def test_perturb_by_factor_or_resample_and_nothing_else():
    values = {"optimizer.learning_rate": 0.1, "optimizer.weight_decay": 1e-4, "train.steps": 800}
    rules = {"optimizer.learning_rate": (0.8, 1.25), "optimizer.weight_decay": "resample"}
    new = pbt.perturb(values, rules, seed=7, resample=lambda: {"optimizer.weight_decay": 3e-3})
    assert new["optimizer.learning_rate"] in (pytest.approx(0.08), pytest.approx(0.125))
    assert new["optimizer.weight_decay"] == 3e-3 and new["train.steps"] == 800 and values["train.steps"] == 800
    with pytest.raises(SweepError, match=r"PERTURB 'optimizer.learning_rate': 2 is neither"):
        pbt.perturb(values, {"optimizer.learning_rate": 2}, seed=7, resample=dict)


@pytest.mark.parametrize("key, message", [
    ("model.hidden", r"model shapes the checkpoint or the data order"),
    ("optimizer.name", r"optimizer.name shapes the checkpoint"),
    ("train.global_batch_size", r"train.global_batch_size shapes"),
    ("my_width", r"not a declared knob"),
])
def test_keys_that_shape_the_checkpoint_are_refused_in_one_line(key, message):
    with pytest.raises(SweepError, match=message):
        pbt.perturbable(key)
    pbt.perturbable("optimizer.learning_rate")
    pbt.perturbable("optimizer.weight_decay")


# ---------------------------------------------------------------------------- the sweep file and the segments

PBT = """CONFIG = "configs/mlp.py"
ALGORITHM = "pbt"
POPULATION = 4
INTERVAL_STEPS = 10
QUANTILE = 0.25
PERTURB = {"optimizer.learning_rate": (0.8, 1.25), "optimizer.weight_decay": "resample"}

def search_space(trial):
    trial.suggest_float("optimizer.learning_rate", 0.01, 0.5, log=True)
    trial.suggest_float("optimizer.weight_decay", 1e-6, 1e-3, log=True)
    return {"train.steps": 30}
"""


def test_the_shipped_pbt_sweep_checks_against_its_config():
    from mwloop.sweep import pbt_runner, space
    from tests.helpers import ROOT
    loaded = space.load_sweep(f"{ROOT}/experiments/mlp_pbt.py")
    samples = space.check(loaded, f"{ROOT}/{loaded.config}")
    assert loaded.kind == "pbt" and loaded.pruner == "none"
    assert pbt_runner.check_sweep(loaded, samples, 200, None, loaded.pruner) == 12


def _sweep_file(tmp_path, text: str) -> str:
    path = tmp_path / "my_pbt.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("change, message", [
    (('"resample"}', '"resample", "model.hidden": (0.5, 2.0)}'), r"PERTURB 'model.hidden': model shapes the"),
    (('"resample"}', '"resample", "train.steps": (1, 2)}'), r"PERTURB 'train.steps': every segment sets it"),
    (("INTERVAL_STEPS = 10", "INTERVAL_STEPS = 7"), r"INTERVAL_STEPS 7 does not divide train.steps 30"),
    (("QUANTILE = 0.25", "QUANTILE = 0.6"), r"QUANTILE must be in \[0, 0.5\], got 0.6"),
    (("POPULATION = 4", "POPULATION = 1"), r"POPULATION must be an integer >= 2, got 1"),
    (("ALGORITHM = \"pbt\"", "ALGORITHM = \"pb2\""), r"ALGORITHM 'pb2' is unknown; use 'pbt'"),
    (("ALGORITHM = \"pbt\"", ""), r"POPULATION is a setting of population-based training; add ALGORITHM"),
    (("QUANTILE = 0.25", "PRUNER = 'median'"), r"PRUNER 'median' with ALGORITHM = 'pbt'"),
    (("    trial.suggest_float(\"optimizer.weight_decay\", 1e-6, 1e-3, log=True)\n", ""),
     r"PERTURB 'optimizer.weight_decay' is not drawn by search_space"),
])
def test_a_pbt_sweep_file_that_cannot_work_is_one_line_before_anything_is_written(tmp_path, change, message):
    from mwloop import sweep
    workdir = tmp_path / "sweep"
    assert change[0] in PBT
    with pytest.raises(SweepError, match=message) as raised:
        sweep.create_sweep(sweep_spec=_sweep_file(tmp_path, PBT.replace(*change)), sweep_dir=str(workdir))
    assert "\n" not in str(raised.value) and not workdir.exists()


def _run_interval(study, values: dict[int, float]) -> list:
    """What agents do with one interval's segments, without training: ask each, tell its score."""
    from mwloop.sweep import pbt_runner
    asked = []
    for _ in values:
        trial = study.ask()
        assert not pbt_runner.discard_duplicate(study, trial), (trial.number, trial.user_attrs)
        asked.append(trial)
    for trial in asked:
        study.tell(trial, values[trial.user_attrs[pbt_runner.LINEAGE]["member"]])
    return asked


def test_segments_are_enqueued_once_per_interval_with_their_lineage_and_the_winner_is_reproducible(
        tmp_path, monkeypatch):
    from optuna.trial import TrialState

    from mwloop import sweep
    from mwloop.sweep import pbt_report, pbt_runner
    from mwloop.sweep import study as studies
    created = sweep.create_sweep(sweep_spec=_sweep_file(tmp_path, PBT), sweep_dir=str(tmp_path / "sweep"), seed=3)
    assert created.settings.kind == "pbt" and created.settings.n_trials == 12  # 4 members x 3 intervals
    with pytest.raises(SweepError, match=r"study 'my_pbt' exists with another PBT plan \(12 segments, "):
        sweep.create_sweep(sweep_spec=_sweep_file(tmp_path, PBT.replace("POPULATION = 4", "POPULATION = 5")),
                           sweep_dir=str(tmp_path / "sweep"), seed=3)
    # The same file again: the same study, nothing enqueued twice.
    sweep.create_sweep(sweep_spec=_sweep_file(tmp_path, PBT), sweep_dir=str(tmp_path / "sweep"), seed=3)
    study, settings = studies.load(created.storage, created.name, storage_url=created.storage_url)
    segments = pbt_runner.Segments(created.sweep, settings)
    trials = studies.all_trials(study)
    assert sorted(t.user_attrs[studies.ATTR + "point"] for t in trials) == [f"pbt/m{m}/k0" for m in range(4)]
    # Interval 0 is not over: nothing more is enqueued, however often it is asked.
    assert segments.advance(study) == 0 and segments.ready(study, studies.all_trials(study))
    first = _run_interval(study, {0: 0.5, 1: 0.9, 2: 0.1, 3: 0.7})
    overrides, name = pbt_runner.overrides(first[0], "sweep")
    assert name == "m0/k0" and overrides["train.stop_at_step"] == 10 and "init_checkpoint" not in overrides
    assert segments.advance(study) == 4 and segments.advance(study) == 0  # decided once
    trials = studies.all_trials(study)
    second = {t.user_attrs[pbt_runner.LINEAGE]["member"]: t for t in trials if t.state == TrialState.WAITING}
    lineage = {m: t.user_attrs[pbt_runner.LINEAGE] for m, t in second.items()}
    # The worst (m2) copies the best (m1) with perturbed values; the others continue with theirs.
    assert lineage[2]["parent"] == [1, 0] and lineage[2]["exploit"]
    first_values = {t.user_attrs[pbt_runner.LINEAGE]["member"]: t.user_attrs[pbt_runner.LINEAGE]["values"]
                    for t in first}
    assert lineage[2]["values"]["optimizer.learning_rate"] / first_values[1]["optimizer.learning_rate"] in (
        pytest.approx(0.8), pytest.approx(1.25))
    assert all(lineage[m]["parent"] == [m, 0] and lineage[m]["values"] == first_values[m] for m in (0, 1, 3))
    overrides, name = pbt_runner.overrides(second[2], str(tmp_path / "sweep"))
    assert name == "m2/k1" and overrides["init_checkpoint"] == str(tmp_path / "sweep/m1/k0/checkpoints/ckpt-10")
    assert overrides["init_checkpoint_state"] == "all" and overrides["train.stop_at_step"] == 20
    # Two runners that enqueued one segment in a race: the later trial is dropped as surplus, never run, whether
    # it is still waiting (the runner that enqueued it drops it) or an agent asked for it already.
    study.enqueue_trial({}, user_attrs={studies.ATTR + "point": "pbt/m3/k1",
                                        pbt_runner.LINEAGE: lineage[3]})
    stale = studies.all_trials(study)  # what the race's other runner saw: the duplicate still waiting
    assert pbt_runner.drop_waiting_duplicates(study) == 1 and pbt_runner.drop_waiting_duplicates(study) == 0
    monkeypatch.setattr(pbt_runner.studies, "all_trials", lambda *args, **kwargs: stale)
    assert pbt_runner.drop_waiting_duplicates(study) == 0  # it finds it dropped already: nothing raised
    monkeypatch.undo()
    waiting = studies.all_trials(study, states=(TrialState.WAITING,))
    assert sorted(t.user_attrs[pbt_runner.LINEAGE]["member"] for t in waiting) == [0, 1, 2, 3]
    study.enqueue_trial({}, user_attrs={studies.ATTR + "point": "pbt/m0/k1",
                                        pbt_runner.LINEAGE: lineage[0]})
    _run_interval(study, {0: 0.6, 1: 0.95, 2: 0.92, 3: 0.2})
    duplicate = study.ask()
    assert pbt_runner.discard_duplicate(study, duplicate)
    assert segments.advance(study) == 4
    _run_interval(study, {0: 0.7, 1: 0.96, 2: 0.97, 3: 0.9})
    trials = studies.all_trials(study)
    assert segments.advance(study) == 0 and len(studies.counted(trials)) == 12
    best = pbt_report.winner(trials, "max")
    assert best.user_attrs[pbt_runner.LINEAGE]["member"] == 2
    chain = pbt_report.chain(trials, best)
    assert [t.user_attrs[pbt_runner.LINEAGE]["member"] for t in chain] == [1, 2, 2]
    command = pbt_report.reproduce_command(trials, best, settings.config, "out")
    parts = command.split(" && ")
    assert len(parts) == 3 and all(p.startswith("python -m mwloop.main --config=configs/mlp.py") for p in parts)
    assert "--workdir=out/k0" in parts[0] and "init_checkpoint" not in parts[0]
    assert "--config.init_checkpoint=out/k1/checkpoints/ckpt-20" in parts[2]
    assert "--config.train.stop_at_step=30" in parts[2] and "--config.export=false" in parts[1]
    assert "export" not in parts[2]  # the member's last segment exports as the config says
    table = pbt_report.lineage_markdown(trials, "eval/accuracy", ["optimizer.learning_rate"])
    assert "| m2/k1 | 10-20 | m1/k0 | yes |" in table and table.count("\n") == 13


def test_an_idle_agent_that_finds_nothing_running_looks_again_before_leaving(tmp_path):
    """Another agent told the interval's last segment and has not yet enqueued the next: an idle agent whose
    look found that segment running must not leave the study (it enqueues the interval itself); once nothing
    is due nor running, it leaves."""
    import threading

    from mwloop import sweep
    from mwloop.sweep import pbt_runner
    from mwloop.sweep import study as studies
    created = sweep.create_sweep(sweep_spec=_sweep_file(tmp_path, PBT), sweep_dir=str(tmp_path / "sweep"), seed=3)
    study, settings = studies.load(created.storage, created.name, storage_url=created.storage_url)
    segments = pbt_runner.Segments(created.sweep, settings)
    # Set: a wait that stays returns at once instead of polling.
    stopping = threading.Event()
    stopping.set()
    _run_interval(study, {0: 0.5, 1: 0.9, 2: 0.1, 3: 0.7})
    # Nothing running, interval 1 not enqueued yet: due now, so the agent stays.
    assert segments.wait(study, stopping)
    assert len(studies.all_trials(study, states=(TrialState.WAITING,))) == 4
    _run_interval(study, {0: 0.6, 1: 0.95, 2: 0.92, 3: 0.2})
    assert segments.wait(study, stopping)
    _run_interval(study, {0: 0.7, 1: 0.96, 2: 0.97, 3: 0.9})
    assert len(studies.counted(studies.all_trials(study))) == 12
    assert not segments.wait(study, stopping)
