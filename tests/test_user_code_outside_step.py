"""User code that misbehaves outside the step (issue 31 item 6): a sys.exit in the user's code, a get_config
without its return, an op of the task's own code that fails when the graph runs, a NaN in one loss part."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mwloop.step import graph_checks, user_code
from tests.helpers import ROOT

# What TensorFlow 2.21 says when the task's own sparse cross-entropy gets a label out of range (cut down).
GRAPH_ERROR = """Graph execution error:

Detected at node while/SparseSoftmaxCrossEntropyWithLogits defined at (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main

  File "{mwloop}/step/losses.py", line 96, in compute_loss

  File "{mwloop}/step/user_code.py", line 99, in call

  File "{user}", line 3, in loss

Received a label value of 2 which is outside the valid range of [0, 2).  Label values: 0 1 2 1
\t [[{{{{node while/SparseSoftmaxCrossEntropyWithLogits}}}}]] [Op:__inference_train_loop_fn_699]"""


def _exit_from(path) -> SystemExit:
    code = compile("import sys\n\nsys.exit(0)\n", str(path), "exec")
    try:
        exec(code, {})
    except SystemExit as e:
        return e
    raise AssertionError("no SystemExit")


def test_a_sys_exit_in_a_users_file_is_named_with_its_line(tmp_path):
    where = user_code.raised_in_user_code(_exit_from(tmp_path / "task.py"))
    assert where.startswith(f" at {tmp_path / 'task.py'}:3")


def test_mwloops_and_libraries_own_exits_are_not_the_users():
    import absl.app
    path = absl.app.__file__
    assert user_code.raised_in_user_code(_exit_from(path)) == ""
    assert user_code.raised_in_user_code(_exit_from(graph_checks.__file__)) == ""


def test_a_user_op_that_fails_in_the_graph_is_one_line_with_method_line_and_what_to_check(tmp_path):
    user = tmp_path / "my_task.py"
    user.write_text("import tensorflow as tf\n\n    return tf.nn.sparse_softmax_cross_entropy_with_logits(x)\n")
    mwloop_dir = user_code._MWLOOP.rstrip("/")
    line = graph_checks.user_op_error(GRAPH_ERROR.format(mwloop=mwloop_dir, user=user))
    assert line == (f"task method loss failed when the step ran, at {user}:3 (return "
                    f"tf.nn.sparse_softmax_cross_entropy_with_logits(x)): Received a label value of 2 which is outside "
                    f"the valid range of [0, 2); check the values its inputs get (label ranges, shapes, indices) "
                    f"against what that op expects")


def test_an_op_of_mwloops_own_is_left_alone():
    text = GRAPH_ERROR.format(mwloop=user_code._MWLOOP.rstrip("/"), user=user_code._MWLOOP + "step/steps.py")
    assert graph_checks.user_op_error(text) is None
    assert graph_checks.user_op_error("Graph execution error: no trace") is None


def test_a_nan_loss_part_is_named_with_its_data():
    from mwloop.loop import loops
    line = loops.nonfinite_message(3, {"loss_sum/main": 1.0, "loss_sum/aux": float("nan"), "examples": 32.0}, "")
    assert line.startswith("non-finite loss at step 3 in loss part loss/aux; check what that part computes and "
                           "its data")
    assert loops.nonfinite_message(3, {"loss_sum": float("nan")}, "!") == \
        "non-finite loss at step 3; lower the learning rate!"


@pytest.mark.slow
def test_a_task_that_exits_in_its_data_ends_the_run_with_exit_2_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mwloop.main", "--config=tests/misbehaving_task.py:exit_in_dataset",
                          f"--workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: user code called sys.exit(0) at tests/misbehaving_task.py:24 (sys.exit(0)); "
                           "nothing after it ran"), last
