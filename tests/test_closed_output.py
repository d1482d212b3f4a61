"""A reader that goes away does not stop training (issue 31 item 3): `launch ... | head -1` used to hang for
good, the launcher's output threads dead of BrokenPipeError and the workers blocked on full pipes. Now the
closed stream points at /dev/null, is noted once on stderr, the launcher keeps draining, and the job trains
to its end and saves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import warm_main
from tests.helpers import ROOT

PY = sys.executable
# 20000 lines of 100 bytes: far more than a pipe holds once its reader has gone.
PRINTS = "[print('x' * 99) for i in range(20000)]"


def _run_reading_one_line(code: str, timeout: float = 60) -> tuple[str, int, str]:
    """`python -c code | head -1` (stderr kept apart): (line read, exit code, stderr)."""
    proc = subprocess.Popen([PY, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    first = proc.stdout.readline().decode()
    proc.stdout.close()
    _, err = proc.communicate(timeout=timeout)
    return first, proc.returncode, err.decode()


def test_print_after_the_reader_left_goes_on_and_notes_it_once():
    first, code, err = _run_reading_one_line(
        "import sys; from mwloop.launcher import closed_output; closed_output.survive_closed_output(); "
        f"{PRINTS}; print('finished', file=sys.stderr)")
    assert first.startswith("x") and code == 0, err
    assert err.count("note: stdout was closed by its reader; training goes on") == 1
    assert "finished" in err and "Traceback" not in err and "BrokenPipe" not in err


def test_without_the_guard_python_dies_of_broken_pipe():  # what the guard is for
    _, code, err = _run_reading_one_line(PRINTS)
    assert code != 0 and "BrokenPipeError" in err


def test_the_launchers_copy_keeps_draining_a_task_after_its_reader_left():
    """An Attempt whose task prints 2 MB: the task must end (it blocked on a full pipe before) and exit 0."""
    child = [PY, "-c", PRINTS]
    code = ("import sys; from mwloop.launcher import attempt, closed_output; closed_output.survive_closed_output(); "
            f"a = attempt.Attempt({child!r}, dict(__import__('os').environ), grace_s=5); p = a.start('worker 0', {{}}, "
            "'-'); p.wait(timeout=50); a.stop(); print('task exit', p.returncode, file=sys.stderr)")
    first, exit_code, err = _run_reading_one_line(code)
    assert first.startswith("[worker 0] x") and exit_code == 0, err
    assert "task exit 0" in err and err.count("note: stdout was closed") == 1


@pytest.mark.slow
def test_launch_piped_to_head_trains_to_its_end_and_saves(tmp_path):
    """`launch 2>&1 | head -1` (tests/stress/head_one.py): the launcher exits 0, the final checkpoint is saved."""
    config = tmp_path / "chatty.py"
    config.write_text("from tests import tiny_task\n\n\ndef get_config(arg=None):\n"
                      "    config = tiny_task.tiny_config()\n    config.distribution.strategy = 'auto'\n"
                      "    config.train.update(steps=400, steps_per_loop=1, log_every_steps=1, eval_every_steps=400, "
                      "checkpoint_every_steps=400)\n    return config\n")
    workdir = tmp_path / "run"
    env = warm_main.serving(dict(os.environ, GCE_METADATA_IP="127.0.0.1:9"))
    run = subprocess.run([PY, "-m", "tests.stress.head_one", "mwloop.launch", "--num_workers=1", "--",
                          f"--config={config}", f"--workdir={workdir}", "--mode=train"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "exited 0 after its reader went away" in run.stdout
    assert (workdir / "checkpoints" / "ckpt-400.index").exists()
