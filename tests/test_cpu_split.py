"""config.distribution.num_cpu_devices: strategy auto replicates over the split CPU, and a strategy that
cannot use the split says so in one warning line (a split CPU used to train on 1 replica without a word).

This process's CPU is already split in 2 (conftest.py), as num_cpu_devices=2 splits a fresh one.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from mwloop.cluster import distribute
from mwloop.config.base import base_config


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    """The warning lines create_strategy logs."""
    lines: list[str] = []
    monkeypatch.setattr(distribute.logging, "warning", lambda message, *args: lines.append(message % args))
    monkeypatch.delenv("TF_CONFIG", raising=False)
    return lines


def strategy_for(strategy: str, num_cpu_devices: int) -> tf.distribute.Strategy:
    config = base_config().distribution
    config.update(strategy=strategy, num_cpu_devices=num_cpu_devices)
    return distribute.create_strategy(config)


def test_auto_with_a_split_cpu_is_mirrored_over_its_devices(warnings):
    strategy = strategy_for("auto", 2)
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == 2
    assert sorted(strategy.extended.worker_devices) == ["/job:localhost/replica:0/task:0/device:CPU:0",
                                                        "/job:localhost/replica:0/task:0/device:CPU:1"]
    assert warnings == []


def test_auto_without_a_split_stays_the_default_strategy(warnings):
    """Even in a process whose CPU someone else split (mwloop.testing.split_cpu): only the config asks."""
    assert strategy_for("auto", 0) is tf.distribute.get_strategy()
    assert warnings == []


def test_a_single_replica_strategy_with_a_split_cpu_says_how_to_get_the_replicas(warnings):
    assert strategy_for("default", 2).num_replicas_in_sync == 1
    assert warnings == ["config.distribution.num_cpu_devices=2 gives no more replicas: strategy 'default' has one "
                        "replica: set config.distribution.strategy=mirrored (or auto) for 2"]
