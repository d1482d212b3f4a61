"""PBT's decisions (mwloop/sweep/pbt.py, docs/pbt.md), in-process: who exploits whom, perturbations, the keys
that may be perturbed."""

from __future__ import annotations

import pytest

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
