"""Learning-rate schedules and the linear scaling rule."""

import pytest

from mwloop.step import optim
from tests.helpers import load_config


@pytest.mark.parametrize("schedule,end", [("cosine", 0.0), ("linear", 0.0), ("constant", 0.2), ("step", 0.0002)])
def test_warmup_then_decay(schedule, end):
    cfg = load_config("mlp", **{"optimizer.schedule": schedule, "optimizer.warmup_steps": 10,
                                "optimizer.learning_rate": 0.1, "optimizer.base_batch_size": 32}).optimizer
    lr = optim.learning_rate(cfg, global_batch_size=64, total_steps=110)  # peak 0.1 * 64 / 32
    assert float(lr(0)) == pytest.approx(0.02)
    assert float(lr(9)) == pytest.approx(0.2)
    assert float(lr(10)) == pytest.approx(0.2)
    assert float(lr(110)) == pytest.approx(end, abs=1e-7)
    assert float(lr(60)) == pytest.approx({"cosine": 0.1, "linear": 0.1, "constant": 0.2, "step": 0.02}[schedule],
                                          rel=1e-5)


def test_unknown_schedule_is_a_clear_error():
    cfg = load_config("mlp", **{"optimizer.schedule": "exponential"}).optimizer
    with pytest.raises(ValueError, match="config.optimizer.schedule='exponential'; use one of constant, cosine"):
        optim.learning_rate(cfg, global_batch_size=64, total_steps=10)
