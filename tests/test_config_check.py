"""One validation point: every entry point (Trainer, train_and_evaluate, main, side-car, sweeps) gives the
same one-line error for a setting that cannot work, before anything is built or written."""

from __future__ import annotations

import os

import ml_collections
import pytest

import mwloop
from mwloop.config import base as config_base
from mwloop.config import check as config_check
from tests import warm_main
from tests.helpers import ROOT

# (key, bad value, the line's fix): every enumerated setting and a range of each kind.
CASES = [
    ("train.steps_per_loop", 0, "use 1 or more steps per loop call"),
    ("train.steps", 0, "train for at least 1 step"),
    ("train.feed", "x", "use one of resident, iterator"),
    ("on_nonfinite", "skp", "use one of fail, skip"),
    ("train.max_to_keep", 0, "keep at least 1 checkpoint"),
    ("train.max_to_keep", -2, "keep at least 1 checkpoint"),
    ("optimizer.ema_momentum", 1.5, "use a value in [0, 1]"),
    ("optimizer.ema_momentum", -0.1, "use a value in [0, 1]"),
    ("train.label_smoothing", 1.0, "use a value in [0, 1)"),
    ("train.label_smoothing", -0.1, "use a value in [0, 1)"),
    ("optimizer.learning_rate", -0.1, "use a non-negative learning rate"),
    ("optimizer.schedule", "exponential", "use one of constant, cosine, linear, step"),
    ("optimizer.momentum", 1.5, "use a value in [0, 1]"),
    ("optimizer.gradient_accumulation_steps", 0, "use 1 (one update per batch) or more"),
    ("optimizer.clip_global_norm", -1.0, "use 0 (no clipping) or a positive norm"),
    ("mixed_precision", "float16", "use one of float32, mixed_bfloat16, mixed_float16"),
    ("distribution.strategy", "tpu", "use one of auto, default, one_device, mirrored"),
    ("distribution.collective", "gloo", "use one of auto, ring, nccl"),
    ("distribution.startup_timeout_s", -1.0, "use 0 (wait forever) or a number of seconds"),
    ("distribution.peer_timeout_s", -1.0, "use 0 (wait forever) or a number of seconds"),
    ("eval.checkpoint", "newest", "use one of latest, best"),
    ("eval.global_batch_size", 0, "use a positive number of examples per eval batch"),
    ("train.eval_every_secs", -5.0, "use 0 (never) or a positive interval"),
    ("best_checkpoint.mode", "maximum", "use one of max, min"),
    ("early_stopping.patience", 0, "use 1 or more evals"),
    ("early_stopping.metric", "accuracy", "name an eval metric as 'SPLIT/NAME'"),
    ("profile_steps", (5, 2), "use (first, last) steps with last > first"),
]


def _config(key: str, value) -> ml_collections.ConfigDict:
    config = config_base.load(os.path.join(ROOT, "configs", "mlp.py"), check=False)
    config.update_from_flattened_dict({key: value})
    return config


@pytest.mark.parametrize("key, value, fix", CASES)
def test_every_entry_point_of_the_python_api_gives_the_same_line(tmp_path, key, value, fix):
    expected = f"config.{key}={value!r}; {fix}"
    for make in (lambda c: mwloop.Trainer(c, str(tmp_path / "run")),
                 lambda c: mwloop.train_and_evaluate(c, str(tmp_path / "run"))):
        with pytest.raises(config_check.ConfigError) as error:
            make(_config(key, value))
        assert str(error.value).startswith(expected) and "\n" not in str(error.value)
    assert not (tmp_path / "run").exists(), "nothing may be written before the check"


@pytest.mark.slow
def test_the_command_line_gives_the_line_the_python_api_gives(tmp_path):
    for key, value, fix in (CASES[0], CASES[2], CASES[3]):
        flag_value = value if isinstance(value, str) else repr(value)
        result = warm_main.run(["--config=configs/mlp.py", f"--workdir={tmp_path / 'run'}",
                                f"--config.{key}={flag_value}"], env=dict(os.environ, PYTHONPATH=ROOT))
        assert result.returncode == 2, result.stderr[-2000:]
        assert result.stderr.strip().splitlines()[-1] == f"error: config.{key}={value!r}; {fix}"
    assert not (tmp_path / "run").exists()


def test_a_mode_that_does_not_exist_is_named():
    with pytest.raises(config_check.ConfigError, match=r"--mode='trian' is unknown; use one of train, eval"):
        config_check.check(config_base.base_config(), "trian")


def test_a_task_config_without_the_built_in_keys_passes():
    config = ml_collections.ConfigDict({"train": {"steps": 10, "steps_per_loop": 5}})
    config_check.check(config)  # only what is present is checked


def test_the_base_config_and_every_shipped_config_pass():
    config_check.check(config_base.base_config(), "train_and_eval")
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".py"):
            config_check.check(config_base.load(os.path.join(ROOT, "configs", name)))


def test_combinations_that_need_the_strategy_or_the_task():
    config = _config("train.global_batch_size", 30)
    with pytest.raises(config_check.ConfigError, match=r"global_batch_size=30 does not divide among 4 replicas"):
        config_check.check_run(config, num_replicas=4)
    config = _config("optimizer.gradient_accumulation_steps", 2)
    with pytest.raises(config_check.ConfigError, match=r"a task's own train_step"):
        config_check.check_run(config, num_replicas=1, custom_train_step=True)
    config = _config("on_nonfinite", "skip")
    with pytest.raises(config_check.ConfigError, match=r"not supported with parameter servers"):
        config_check.check_run(config, num_replicas=1, parameter_server=True)


def test_load_config_is_the_config_the_command_line_gets_and_is_checked():
    config = mwloop.load_config(os.path.join(ROOT, "configs", "resnet.py") + ":digits", {"train.steps": 7})
    assert config.train.steps == 7 and config.name == "resnet-digits"
    with pytest.raises(mwloop.UserError, match=r"^config.train.steps_per_loop=0; use 1 or more steps per loop"):
        mwloop.load_config(os.path.join(ROOT, "configs", "mlp.py"), {"train.steps_per_loop": 0})
    with pytest.raises(mwloop.UserError, match=r"config override train.stpes=3: .*check the key and the type"):
        mwloop.load_config(os.path.join(ROOT, "configs", "mlp.py"), {"train.stpes": 3})
    with pytest.raises(mwloop.UserError, match=r"config file 'configs/nope.py' not found"):
        mwloop.load_config("configs/nope.py")


def test_build_optimizer_is_the_optimizer_a_run_trains_with():
    import keras
    config = mwloop.load_config(os.path.join(ROOT, "configs", "mlp.py"),
                                {"mixed_precision": "mixed_float16", "optimizer.clip_global_norm": 1.0})
    optimizer = mwloop.build_optimizer(config)
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)  # loss scaling, as state.create adds it
    assert optimizer.inner_optimizer.global_clipnorm is None  # clipping taken over: mwloop clips the replicas' sum
    keras.mixed_precision.set_global_policy("float32")


def test_an_unknown_writer_is_refused_before_anything_is_built(tmp_path):
    config = _config("writers", ("tensorboard", "wandb"))
    with pytest.raises(config_check.ConfigError, match=r"^config.writers has 'wandb'; use any of 'tensorboard', "
                                                       r"'mlflow' \(metrics.jsonl is always written\)$"):
        mwloop.Trainer(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
