"""Cluster configuration: TF_CONFIG validation (one-line errors), evaluator and Slurm handling."""

import json
import os
import re

import pytest
import tensorflow as tf

from mwloop.cluster import distribute
from tests import warm_main
from tests.helpers import ROOT

WORKERS = {"worker": ["host0:2222", "host1:2222"]}


def tf_config(cluster=WORKERS, task_type="worker", index=0) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


@pytest.mark.parametrize("raw, problem", [
    ("{not json", "TF_CONFIG is not valid JSON"),
    ("[1, 2]", "TF_CONFIG must be a JSON object"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), "TF_CONFIG has no 'cluster' object"),
    (json.dumps({"cluster": WORKERS}), "TF_CONFIG has no 'task' with 'type' and 'index'"),
    (json.dumps({"cluster": WORKERS, "task": {"type": "worker"}}), "TF_CONFIG has no 'task' with 'type' and 'index'"),
    (tf_config(index=2), "TF_CONFIG task index 2 is outside cluster['worker'] (valid: 0..1)"),
    (tf_config(index=-1), "TF_CONFIG task index -1 is not a non-negative integer"),
    (tf_config(index="0"), "TF_CONFIG task index '0' is not a non-negative integer"),
    (tf_config(task_type="master"), "TF_CONFIG task type 'master' is unknown"),
    (tf_config(task_type="chief"), "TF_CONFIG task type 'chief' is not in the cluster (worker)"),
    (tf_config(cluster={"master": ["h:1"], **WORKERS}), "TF_CONFIG cluster has unknown task type 'master'"),
    (tf_config(cluster={"worker": "host0:2222"}), "TF_CONFIG cluster['worker'] must be a list of 'host:port'"),
    (tf_config(cluster={"worker": ["host0"]}), "TF_CONFIG cluster['worker'] address 'host0' is not 'host:port'"),
    (tf_config(cluster={"chief": ["a:1", "b:1"], **WORKERS}), "cluster['chief'] must list exactly one address"),
    (tf_config(cluster={"ps": ["p:1"], **WORKERS}), "lists 'ps' tasks but no 'chief'"),
    (tf_config({"ps": ["p:1"], "chief": ["c:1"]}, "chief"), "lists 'ps' tasks but no 'worker' tasks"),
])
def test_malformed_tf_config_is_one_line_naming_the_problem(raw, problem):
    with pytest.raises(distribute.ClusterConfigError) as error:
        distribute.parse_tf_config(raw)
    assert problem in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("raw", [
    tf_config(),  # worker-only: worker 0 is chief
    tf_config({"chief": ["c:1"], "worker": ["w:1"]}, "chief", 0),  # chief + workers (TFJob, cloud trainers)
    tf_config({"chief": ["c:1"], "worker": ["w:1"], "evaluator": ["e:1"]}, "worker", 0),
    tf_config({"chief": ["c:1"], "worker": ["w:1"]}, "evaluator", 0),  # evaluator outside the cluster
    tf_config({"chief": ["c:1"], "worker": ["w:1"], "ps": ["p:1"]}, "ps", 0),  # parameter servers
])
def test_valid_tf_config(raw):
    assert distribute.parse_tf_config(raw) == json.loads(raw)


def test_unset_or_empty_tf_config_means_no_cluster(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert distribute.parse_tf_config() is None
    assert distribute.parse_tf_config("  ") is None


def distribution_config(**overrides):
    """config.distribution with defaults, updated."""
    from mwloop.config.base import base_config
    config = base_config().distribution
    config.update(overrides)
    return config


def test_evaluator_gets_a_local_strategy_and_is_never_chief(monkeypatch):
    """An evaluator must not join the training collectives, nor write the chief's files."""
    monkeypatch.setenv("TF_CONFIG", tf_config({"chief": ["c:1"], "worker": ["w:1"], "evaluator": ["e:1"]},
                                              "evaluator", 0))
    assert distribute.is_evaluator() and distribute.cluster_configured()
    for name in ("auto", "multi_worker"):
        config = distribution_config(strategy=name)
        strategy = distribute.create_strategy(config)
        assert not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        assert not distribute.is_chief(strategy)


def test_slurm_cluster_without_tf_config(monkeypatch):
    """Two Slurm tasks on two nodes: worker i is task SLURM_PROCID (GPU-less nodes need no nvidia-smi)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "TF_CONFIG", "CUDA_VISIBLE_DEVICES")}
    env.update(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="node[1-2]",
               SLURM_STEP_TASKS_PER_NODE="1(x2)")
    monkeypatch.setattr(os, "environ", env)  # the resolver also writes CUDA_VISIBLE_DEVICES: keep it here
    monkeypatch.setattr(distribute.shutil, "which", lambda name: None)
    assert distribute.cluster_configured()
    resolver = distribute._cluster_resolver()
    assert resolver.cluster_spec().as_dict() == {"worker": ["node1:8888", "node2:8888"]}
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.num_accelerators() == {}  # CPU workers


@pytest.mark.slow
def test_main_rejects_malformed_tf_config_in_one_line_before_writing(tmp_path):
    workdir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2",
               TF_CONFIG=tf_config({"worker": ["localhost:1", "localhost:2"]}, "worker", 3))
    proc = warm_main.run([f"--config={ROOT}/configs/mlp.py", f"--workdir={workdir}"], env=env, cwd=str(tmp_path),
                         timeout=120)
    assert proc.returncode == 2  # errors.USER_ERROR
    message = "error: TF_CONFIG task index 3 is outside cluster['worker'] (valid: 0..1)"
    # Apart from TensorFlow's C++ start-up lines and absl log records, stderr is the one error line.
    tf_chatter = re.compile(r"^(WARNING: All log messages before absl|[IWEF]\d{4} )")
    assert [line for line in proc.stderr.splitlines() if not tf_chatter.match(line)] == [message], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert os.listdir(tmp_path) == []  # no workdir, nothing else either


def test_negative_bytes_per_pack_is_one_line():
    config = distribution_config(strategy="default")
    config.bytes_per_pack = -5
    with pytest.raises(ValueError, match=r"^config.distribution.bytes_per_pack=-5; use 0"):
        distribute.create_strategy(config)
