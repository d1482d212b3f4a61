"""User code that misbehaves outside the step (issue 31 item 6): a sys.exit in the user's code, a get_config
without its return, an op of the task's own code that fails when the graph runs, a NaN in one loss part."""

from __future__ import annotations

import os
import sys

import pytest

from mwloop import errors
from mwloop.step import graph_checks
from tests import warm_main

# What TensorFlow 2.21 says when the task's own sparse cross-entropy gets a label out of range (cut down).
GRAPH_ERROR = """Graph execution error:

Detected at node while/SparseSoftmaxCrossEntropyWithLogits defined at (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main

  File "{mwloop}/step/losses.py", line 96, in compute_loss

  File "{mwloop}/step/user_code.py", line 99, in call

  File "{user}", line 3, in loss

Received a label value of 2 which is outside the valid range of [0, 2).  Label values: 0 1 2 1
\t [[{{{{node while/SparseSoftmaxCrossEntropyWithLogits}}}}]] [Op:__inference_train_loop_fn_699]"""


def _exit_from(path, body: str = "import sys\n\nsys.exit(0)\n") -> SystemExit:
    """The SystemExit of `body` run as the file `path`, its traceback from that file's frame inward (as mwloop.main
    sees an exit of code it called: its own frames, then the user's)."""
    path.write_text(body)  # the line of code in the message is read from the file
    code = compile(body, str(path), "exec")
    try:
        exec(code, {})
    except SystemExit as e:
        e.__traceback__ = e.__traceback__.tb_next  # not this test's own frame
        return e
    raise AssertionError("no SystemExit")


def _exit_from_file(filename: str) -> SystemExit:
    """A SystemExit whose only frame claims to be in `filename` (a file not to be written)."""
    try:
        exec(compile("import sys\n\nsys.exit(0)\n", filename, "exec"), {})
    except SystemExit as e:
        e.__traceback__ = e.__traceback__.tb_next
        return e
    raise AssertionError("no SystemExit")


def test_a_sys_exit_in_a_users_file_is_named_with_its_line(tmp_path):
    where = errors.exit_site(_exit_from(tmp_path / "task.py"))
    assert where == f" at {tmp_path / 'task.py'}:3 (sys.exit(0))"


def test_mwloops_and_libraries_own_exits_are_not_the_users():
    import absl.app
    assert errors.exit_site(_exit_from_file(absl.app.__file__)) == ""
    assert errors.exit_site(_exit_from_file(graph_checks.__file__)) == ""


def test_a_library_exit_called_from_a_users_file_is_the_users_inside_that_library(tmp_path):
    body = "import argparse\n\nargparse.ArgumentParser().parse_args(['--config=x'])\n"
    assert errors.exit_site(_exit_from(tmp_path / "cfg.py", body)) == (
        f" at {tmp_path / 'cfg.py'}:3 (argparse.ArgumentParser().parse_args(['--config=x'])), inside argparse")


def test_a_user_op_that_fails_in_the_graph_is_one_line_with_method_line_and_what_to_check(tmp_path):
    user = tmp_path / "my_task.py"
    user.write_text("import tensorflow as tf\n\n    return tf.nn.sparse_softmax_cross_entropy_with_logits(x)\n")
    mwloop_dir = errors.MWLOOP_DIR.rstrip("/")
    line = graph_checks.user_op_error(GRAPH_ERROR.format(mwloop=mwloop_dir, user=user))
    assert line == (f"task method loss failed when the step ran, at {user}:3 (return "
                    f"tf.nn.sparse_softmax_cross_entropy_with_logits(x)): Received a label value of 2 which is outside "
                    f"the valid range of [0, 2); check the values its inputs get (label ranges, shapes, indices) "
                    f"against what that op expects")


def test_an_op_of_mwloops_own_is_left_alone():
    text = GRAPH_ERROR.format(mwloop=errors.MWLOOP_DIR.rstrip("/"), user=errors.MWLOOP_DIR + "step/steps.py")
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
    run = warm_main.run(["--config=tests/misbehaving_task.py:exit_in_dataset", f"--workdir={tmp_path}"], timeout=180)
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: user code called sys.exit(0) at tests/misbehaving_task.py:24 (sys.exit(0)); "
                           "nothing after it ran"), last


# Issue 47 item 2: user code that ends the process while its module is imported (config.task, config.actions).
def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return f"{name}:Task"


@pytest.mark.parametrize("body, call, line", [
    ("import argparse\nargparse.ArgumentParser().parse_args(['--nope'])\n", r"sys\.exit\(2\)", 2),
    ("import sys\n\nsys.exit('no GPU')\n", r"sys\.exit\('no GPU'\)", 3),
    ("import os\nos._exit(3)\n", r"os\._exit\(3\)", 2),
    ("from os import _exit\n_exit(4)\n", r"os\._exit\(4\)", 2),
])
def test_a_module_that_ends_the_process_at_import_is_a_one_line_task_error_naming_its_line(
        tmp_path, monkeypatch, body, call, line):
    from mwloop import task as task_lib
    spec = _module(tmp_path, monkeypatch, f"exits_{line}_{abs(hash(body)) % 1000}", body)
    real_exit = os._exit
    with pytest.raises(task_lib.TaskError, match=rf"^config\.task='{spec}': importing \S+ ended the process: user "
                                                 rf"code called {call} at {tmp_path}/\S+\.py:{line} "):
        task_lib.import_object(spec, "config.task")
    assert os._exit is real_exit  # the stand-in lives only while the module is imported


def test_a_library_exit_names_the_library_and_the_users_line(tmp_path, monkeypatch):
    from mwloop import task as task_lib
    spec = _module(tmp_path, monkeypatch, "parses", "import argparse\n\nargparse.ArgumentParser().parse_args(['-x'])\n")
    with pytest.raises(task_lib.TaskError, match=r"parses\.py:3 \(argparse\.ArgumentParser\(\)\.parse_args\(\['-x'\]\)"
                                                 r"\), inside argparse; a module must not exit"):
        task_lib.import_object(spec, "config.task")


def test_os_exit_from_another_thread_during_the_import_still_ends_the_process(tmp_path, monkeypatch):
    # The stand-in raises only in the importing thread: another thread's os._exit (mwloop's own watchdogs) goes to
    # the real one, here a recorder in its place.
    from mwloop import task as task_lib
    ended = []
    monkeypatch.setattr(os, "_exit", ended.append)
    body = "import os, threading\nt = threading.Thread(target=os._exit, args=(5,))\nt.start(); t.join()\nTask = 1\n"
    spec = _module(tmp_path, monkeypatch, "threads", body)
    assert task_lib.import_object(spec, "config.task") == 1
    assert ended == [5]
