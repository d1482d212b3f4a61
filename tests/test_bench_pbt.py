"""benchmarks/pbt.py's pure parts (issue 46's comparison): the sweep files it writes and its summary."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import pbt as bench
from mwloop.sweep import space


def test_each_method_gets_the_same_task_steps_and_ranges(tmp_path):
    args = argparse.Namespace(config="configs/resnet.py", population=8, interval=50, steps=300)
    loaded = {}
    for method in ("pbt", "random", "tpe"):
        (tmp_path / f"{method}.py").write_text(bench.sweep_file(method, args))
        loaded[method] = space.load_sweep(str(tmp_path / f"{method}.py"))
    assert {s.config for s in loaded.values()} == {"configs/resnet.py"}
    assert loaded["pbt"].kind == "pbt" and loaded["pbt"].pbt["population"] == 8
    assert (loaded["random"].sampler, loaded["tpe"].sampler, loaded["tpe"].n_trials) == ("random", "tpe", 8)
    assert loaded["tpe"].pruner == "none"
    samples = [space.probe(s, samples=4)[0] for s in loaded.values()]
    assert all(o["train.steps"] == 300 and o["train.checkpoint_every_steps"] == 50 for sample in samples
               for o in sample)


def test_summary_is_per_method_over_seeds_with_the_loss_when_known():
    runs = [{"method": "pbt", "seed": 0, "best": 0.99, "best_loss": 0.04, "wall_s": 10.0},
            {"method": "pbt", "seed": 1, "best": 0.97, "best_loss": 0.06, "wall_s": 20.0},
            {"method": "tpe", "seed": 0, "best": 0.98, "wall_s": 5.0}]
    summary = bench.summarize(runs)
    assert summary["pbt"]["mean"] == pytest.approx(0.98) and summary["pbt"]["stdev"] == pytest.approx(0.01414, 1e-3)
    assert summary["pbt"]["loss_mean"] == pytest.approx(0.05) and summary["pbt"]["wall_s"] == 15.0
    assert summary["tpe"]["stdev"] == 0.0 and summary["tpe"]["loss_mean"] is None and summary["tpe"]["seeds"] == 1
