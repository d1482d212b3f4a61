"""config.init_checkpoint_state="all" and config.train.stop_at_step (docs/pbt.md): a run cut at a step and continued
in a fresh directory from the first one's checkpoint is the uninterrupted run, bitwise; in-process."""

from __future__ import annotations

import numpy as np
import pytest

import mwloop
from mwloop.artifacts import checkpoint
from mwloop.step import optim
from tests.helpers import load_config

# A constant rate is a variable of the optimizer that its checkpoint holds: the continued run keeps its own.
SETTINGS = {"distribution.strategy": "default", "deterministic": True, "writers": (), "export": False,
            "train.steps": 30, "train.steps_per_loop": 10, "train.log_every_steps": 0, "train.eval_every_steps": 0,
            "train.checkpoint_every_steps": 0, "optimizer.schedule": "constant"}


def _train(workdir, **overrides) -> tuple[list[np.ndarray], int]:
    with mwloop.Trainer(load_config("mlp", **{**SETTINGS, **overrides}), str(workdir), evaluate=False,
                        preemption=False) as trainer:
        trainer.train()
        state = [v.numpy() for v in trainer.state.model.weights + trainer.state.optimizer.variables]
        return state, trainer.step


@pytest.mark.slow
def test_a_run_continued_from_another_directorys_checkpoint_equals_the_uninterrupted_run_bitwise(tmp_path):
    whole, last = _train(tmp_path / "whole")
    assert last == 30
    # Ends at step 20 as at its last: its final checkpoint is written there (no periodic ones).
    _, stopped = _train(tmp_path / "first", **{"train.stop_at_step": 20})
    assert stopped == 20
    assert [p.rsplit("/", 1)[1] for p in checkpoint.saved_checkpoints(str(tmp_path / "first/checkpoints"))] == \
        ["ckpt-20"]
    continued, last = _train(tmp_path / "second", init_checkpoint=str(tmp_path / "first"),
                             init_checkpoint_state="all")
    assert last == 30
    # Weights, momentum slots, iterations and the rate: the same bits.
    assert len(continued) == len(whole) and all(np.array_equal(a, b) for a, b in zip(continued, whole))

    # Another rate (what a perturbed segment passes): the state is the checkpoint's, the rate this run's.
    config = load_config("mlp", **{**SETTINGS, "init_checkpoint": str(tmp_path / "first/checkpoints/ckpt-20"),
                                   "init_checkpoint_state": "all", "optimizer.learning_rate": 0.05})
    with mwloop.Trainer(config, str(tmp_path / "perturbed"), evaluate=False, preemption=False) as trainer:
        assert trainer.step == 20 and int(trainer.state.optimizer.iterations.numpy()) == 20
        assert optim.current_learning_rate(trainer.state.optimizer) == pytest.approx(0.05)
        assert trainer.restored is None
    # A resume of its own that may change the rate (train.allow_changed) trains with the new one too.
    config = load_config("mlp", **{**SETTINGS, "optimizer.learning_rate": 0.05,
                                   "train.allow_changed": "optimizer.learning_rate"})
    with mwloop.Trainer(config, str(tmp_path / "first"), evaluate=False, preemption=False) as trainer:
        assert trainer.step == 20 and trainer.restored is not None
        assert optim.current_learning_rate(trainer.state.optimizer) == pytest.approx(0.05)
