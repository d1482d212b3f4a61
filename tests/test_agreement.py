"""Every task runs the chief's run (mwloop.cluster.agreement): the comparison, the line, the side-car's record,
and one real 2-worker check through TensorFlow's coordination service."""

import json
import os
import subprocess
import sys
import textwrap

import portpicker
import pytest
import tensorflow as tf

from mwloop.cluster import agreement
from mwloop.config import base as config_base
from mwloop.errors import UserError
from tests.helpers import ROOT, load_config
from tests.tiny_task import TinyTask, tiny_config

BATCH_LINE = ("worker 1 runs another run than the chief: train.global_batch_size=48 here, 64 on the chief; start "
              "every task with the same config and overrides")
MODEL_LINE = ("worker 1 runs another run than the chief: model.hidden=[64] here, [32] on the chief; start every "
              "task with the same config and overrides")


def _differences(worker_overrides: dict) -> dict:
    chief = agreement.settings(load_config("mlp"))
    worker = agreement.settings(config_base.load(os.path.join(ROOT, "configs", "mlp.py"), None, worker_overrides,
                                                  check=False))
    return agreement.differences(json.loads(json.dumps(worker)), json.loads(json.dumps(chief)))


def test_a_batch_mismatch_is_one_line_naming_the_key_both_values_and_the_fix():
    found = _differences({"train.global_batch_size": 48})
    assert found == {"train.global_batch_size": (48, 64)}
    assert agreement.describe("worker 1", found) == BATCH_LINE


def test_a_model_mismatch_is_one_line_too():
    assert agreement.describe("worker 1", _differences({"model.hidden": (64,)})) == MODEL_LINE


def test_settings_that_decide_when_tasks_meet_in_a_collective_must_agree_per_process_knobs_need_not():
    # Another eval interval or length hangs one worker in a collective the other never joins: compared.
    assert set(_differences({"train.eval_every_steps": 50, "train.steps": 300})) == {
        "train.eval_every_steps", "train.steps"}
    # Every trainer task saves (saving runs collectives): all write asynchronously or none does.
    assert _differences({"train.async_checkpoint": True}) == {"train.async_checkpoint": (True, False)}
    # Threads, timeouts and trackers only change how one process runs.
    assert _differences({"dataset.threads": 4, "distribution.startup_timeout_s": 30.0, "name": "other",
                         "writers": ()}) == {}


def test_the_task_is_part_of_the_run_and_the_cluster_it_was_told_about_part_of_its_environment(monkeypatch):
    config = tiny_config()
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:2"]},
                                                "task": {"type": "worker", "index": 1}}))
    mine = agreement.settings(config, TinyTask(config))
    assert mine["task.class"] == "TinyTask" and len(mine["task.source_sha256"]) == 12
    environment = agreement.environment(tf.distribute.get_strategy())
    assert environment["cluster"] == {"worker": ["a:1", "b:2"]}
    assert environment["local_devices"] == 1 and environment["versions.tensorflow"] == tf.__version__
    assert len(environment["mwloop.source_sha256"]) == 12
    chiefs = dict(environment, cluster={"worker": ["a:1", "b:2", "c:3"]})
    assert agreement.describe("worker 1", agreement.differences(environment, chiefs)) == (
        "worker 1 runs another run than the chief: cluster={worker: 2} here, {worker: 3} on the chief; give every "
        "task the same cluster in TF_CONFIG (only its task differs)")


def test_a_cluster_of_as_many_tasks_at_other_addresses_shows_the_addresses_and_other_installs_their_versions():
    mine = {"cluster": {"worker": ["a:1", "c:3"]}, "versions.tensorflow": "2.21.0", "local_devices": 1}
    chiefs = {"cluster": {"worker": ["a:1", "b:2"]}, "versions.tensorflow": "2.20.0", "local_devices": 2}
    assert agreement.describe("worker 1", agreement.differences(mine, chiefs)) == (
        "worker 1 runs another run than the chief: cluster={worker: [a:1, c:3]} here, {worker: [a:1, b:2]} on the "
        "chief; local_devices=1 here, 2 on the chief; versions.tensorflow=2.21.0 here, 2.20.0 on the chief; "
        "give every task the same cluster in TF_CONFIG (only its task differs) and give every worker as many "
        "devices (CUDA_VISIBLE_DEVICES) and install the same TensorFlow, Keras, Python and mwloop on every machine")


def test_a_task_class_defined_in_another_module_name_is_the_same_task():
    # A class defined in a config file is loaded under a module name of its own in each process.
    assert agreement.differences({"task": "<class 'config_123.MyTask'>"}, {"task": "<class 'config_987.MyTask'>"}) \
        == {}


def test_single_process_strategies_have_nothing_to_agree_on():
    agreement.check_cluster(tf.distribute.get_strategy(), tiny_config(), chief=True)


def _record(workdir, config) -> None:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort())


def test_the_evaluator_compares_with_the_chiefs_config_json(tmp_path):
    workdir = str(tmp_path)
    assert agreement.check_recorded(load_config("mlp"), workdir) is False  # no record yet: checked later
    _record(workdir, load_config("mlp"))
    # Its own strategy, eval batch and timeouts are its own.
    assert agreement.check_recorded(load_config("mlp", **{"distribution.strategy": "default",
                                                          "eval.global_batch_size": 10}), workdir) is True
    # It writes no checkpoint: the trainer's asynchronous writes are none of its business.
    assert agreement.check_recorded(load_config("mlp", **{"train.async_checkpoint": True}), workdir) is True
    with pytest.raises(UserError) as error:
        agreement.check_recorded(load_config("mlp", **{"model.hidden": (64,)}), workdir)
    assert str(error.value) == (f"the evaluator runs another run than the chief: model.hidden=[64] here, [32] in "
                                f"{workdir}/config.json; start every task with the same config and overrides")


def test_an_evaluator_told_more_steps_waits_for_the_trainer_one_told_fewer_is_refused(tmp_path):
    workdir = str(tmp_path)
    _record(workdir, load_config("mlp", **{"train.steps": 40}))
    assert agreement.check_recorded(load_config("mlp", **{"train.steps": 2000}), workdir)  # stops when it is gone
    with pytest.raises(UserError, match=r"train\.steps=20 here, 40 in "):
        agreement.check_recorded(load_config("mlp", **{"train.steps": 20}), workdir)


def test_a_task_that_never_answers_is_named_after_the_timeout(monkeypatch):
    class Silent:  # the coordination service of a cluster whose worker 1 never reaches the check
        def get_config_key_value(self, key, timeout_in_ms):
            raise tf.errors.DeadlineExceededError(None, None, "timed out")
    monkeypatch.setattr(agreement.context, "context", Silent)
    monkeypatch.setattr(agreement, "POLL_S", 0.01)
    with pytest.raises(UserError, match=r"^worker 1's check of the run settings did not come within 0 s \(config"
                                        r"\.distribution\.startup_timeout_s\): that task is stuck before training"):
        agreement._get("k", "worker 1's check of the run settings", timeout_s=0.05)


# Two tasks on localhost: the same settings pass (and say how long the check took), then worker 1 with another
# global batch stops both with the same line. No data, no model: only the strategy and the check.
_TASK = textwrap.dedent("""
    import json, sys, time
    import tensorflow as tf
    from mwloop.cluster import agreement, distribute
    from mwloop.errors import UserError
    from tests.helpers import load_config
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    chief = distribute.is_chief(strategy)
    started = time.perf_counter()
    agreement.check_cluster(strategy, load_config("mlp"), chief=chief, timeout_s=60)
    print(f"agreed in {(time.perf_counter() - started) * 1000:.1f} ms", flush=True)
    batch = 48 if not chief else 64
    try:
        agreement.check_cluster(strategy, load_config("mlp", **{"train.global_batch_size": batch}), chief=chief,
                                timeout_s=60)
    except UserError as e:
        print(f"error: {e}", flush=True)
    try:  # --mode=train on the chief, train_and_eval on worker 1: the Trainer says whether it evaluates
        agreement.check_cluster(strategy, load_config("mlp"), chief=chief, timeout_s=60,
                                extra={"trainer.evaluate": not chief})
    except UserError as e:
        print(f"error: {e}", flush=True)
""")


@pytest.mark.slow
def test_two_real_workers_agree_then_both_refuse_a_batch_mismatch_and_another_mode():
    cluster = {"worker": [f"localhost:{portpicker.pick_unused_port()}" for _ in range(2)]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", GCE_METADATA_IP="127.0.0.1:9")
    procs = [subprocess.Popen([sys.executable, "-c", _TASK], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL,
                              env=dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                                                  "task": {"type": "worker", "index": i}})))
             for i in range(2)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for output in outputs:
        lines = output.splitlines()
        assert lines[0].startswith("agreed in ") and float(lines[0].split()[2]) < 1000, output
        assert lines[1] == f"error: {BATCH_LINE}", output
        assert lines[2] == ("error: worker 1 runs another run than the chief: trainer.evaluate=true here, false on "
                            "the chief; start every task with the same config and overrides"), output
    print(*(o.splitlines()[0] for o in outputs))
