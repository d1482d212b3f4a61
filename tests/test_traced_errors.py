"""A mistake in a task's traced code is one line naming the task method and the user's file:line, on every
strategy: the default strategy always gave it; Mirrored and MultiWorkerMirrored lost it when TensorFlow raised
the error on the strategy's main thread (the merge_call of a collective the task called), a compiled step
(config.jit_compile) and parameter servers when autograph rewrote it into a StagingError paragraph. Then
mwloop.main exits 2 and the launcher stops at once (a restart would only repeat it).

The tasks are tests/raising_task.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mwloop.run import train
from mwloop.step import user_code
from mwloop.task import TaskError
from tests import raising_task, tiny_task, warm_main
from tests.helpers import ROOT

RAISING = os.path.join(ROOT, "tests", "raising_task.py")


def line_of(code: str) -> str:
    """`raising_task.py:N (code)`: where the user's line `code` is, as the one-line error names it."""
    with open(RAISING) as f:
        number = next(i for i, line in enumerate(f, 1) if line.strip() == code)
    return f"raising_task.py:{number} ({code})"


def error_on_two_replicas(task: type, strategy, tmp_path, **overrides) -> str:
    config = tiny_task.tiny_config(task, **{"distribution.strategy": "mirrored", **overrides})
    with pytest.raises(TaskError) as error:
        train.train_and_evaluate(config, str(tmp_path / "run"), strategy=strategy)
    assert "\n" not in str(error.value)
    return str(error.value)


SHAPES = 'raise ValueError(f"labels {batch[\'label\'].shape} do not match logits {outputs.shape}")'
DROPOUT = 'raise ValueError("dropout rate must be in [0, 1)")'


@pytest.mark.parametrize("task, overrides, message, code", [
    (raising_task.LossRaises, {}, "task LossRaises.loss raised ValueError: labels (None,) do not match logits "
                                  "(None, 3) at ", SHAPES),
    (raising_task.TrainRaises, {}, "task TrainRaises.forward raised ValueError: dropout rate must be in [0, 1) at ",
     DROPOUT),
    (raising_task.TrainRaises, {"jit_compile": True},
     "task TrainRaises.forward raised ValueError: dropout rate must be in [0, 1) at ", DROPOUT),
    (raising_task.TrainRaises, {"jit_compile": True, "optimizer.gradient_accumulation_steps": 2},
     "task TrainRaises.forward raised ValueError: dropout rate must be in [0, 1) at ", DROPOUT),
    (raising_task.EvalStepRaises, {}, "task EvalStepRaises.eval_step raised ValueError: no eval for this model at ",
     'raise ValueError("no eval for this model")'),
    # Raised by TensorFlow on the main thread, in all_gather's merge_call: not in the task's frames.
    (raising_task.ScalarGather, {}, "task ScalarGather.loss raised ValueError: ",
     "total = tf.distribute.get_replica_context().all_gather(tf.reduce_sum(outputs), axis=0)"),
], ids=["loss", "train_step", "jit_compile", "jit_compile_accumulated", "eval_step", "merge_call"])
def test_a_traced_error_on_two_mirrored_replicas_is_one_line_naming_method_and_line(
        tmp_path, mirrored_strategy, task, overrides, message, code):
    error = error_on_two_replicas(task, mirrored_strategy, tmp_path, **overrides)
    assert error.startswith(message), error
    assert error.endswith(line_of(code)), error


def test_gather_global_batch_in_a_compiled_step_on_two_replicas_is_one_line(tmp_path, mirrored_strategy):
    error = error_on_two_replicas(raising_task.TrainGathers, mirrored_strategy, tmp_path, jit_compile=True)
    assert error.startswith("mwloop.gather_global_batch ran inside a nested tf.function on several replicas"), error
    assert "set jit_compile=False" in error


def test_an_error_outside_the_tasks_code_passes_unchanged():
    """Only an error that stopped a task method waiting in a collective is the task's: mwloop's or
    TensorFlow's own errors keep their type (and traceback, exit 1)."""
    with pytest.raises(RuntimeError, match="^an internal error$"):
        with user_code.one_line_errors():
            raise RuntimeError("an internal error")


@pytest.mark.slow
def test_two_workers_through_the_launcher_stop_at_once_with_the_one_line(tmp_path):
    """The user's case: under MultiWorkerMirrored, TensorFlow's all_gather of a tensor straight from the input
    raises `destinations can not be empty` on the main thread. It used to be a traceback on each worker, exit
    1, and 3 restarts."""
    tmpdir = tmp_path / "worker_tmp"
    tmpdir.mkdir()
    env = warm_main.serving(dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(tmpdir)))
    proc = subprocess.run([sys.executable, "-m", "mwloop.launch", "--num_workers=2", "--max_restarts=3", "--",
                           f"--config={RAISING}:input_gather", f"--workdir={tmp_path / 'run'}"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert output.count("started worker 0 ") == 1 and "restart 1/3" not in output, output[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: worker "), last
    assert ": task InputGather.loss raised ValueError: destinations can not be empty at " in last, last
    code = 'labels = tf.distribute.get_replica_context().all_gather(batch["label"], axis=0)'
    assert f"{line_of(code)} (stopped all workers, no restart: it would repeat)" in last, last
    assert "Traceback" not in output
