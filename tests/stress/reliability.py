"""Kill-and-compare trials: SIGKILL one worker at a random step, let the launcher
restart everyone, and compare the final weights bitwise with an uninterrupted run.

    python -m tests.stress.reliability --trials=10 --num_workers=2

prints one line per trial and `N trials, M bitwise equal`. Not part of the
default suite; tests/test_fault_tolerance.py runs one such trial (with gradient accumulation).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

import numpy as np
import tensorflow as tf
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL_STEPS = 300
RUN_ARGS = ["--config=configs/mlp.py", "--mode=train", f"--config.train.steps={TOTAL_STEPS}",
            "--config.train.steps_per_loop=10", "--config.train.log_every_steps=10",
            "--config.train.checkpoint_every_steps=50", "--config.train.eval_every_steps=0",
            "--config.deterministic=True", "--config.export=False"]


def _command(workdir: str, num_workers: int, max_restarts: int, extra_args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "mwloop.launch", f"--num_workers={num_workers}", f"--max_restarts={max_restarts}",
            "--grace_s=2", "--", *RUN_ARGS, *extra_args, f"--workdir={workdir}"]


def final_state(workdir: str) -> dict[str, np.ndarray]:
    """Every model, optimizer and step tensor of the final checkpoint."""
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints", f"ckpt-{TOTAL_STEPS}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(("model/", "optimizer/", "step/"))}


def run_uninterrupted(workdir: str, num_workers: int, extra_args: Sequence[str] = (),
                      env: dict[str, str] | None = None) -> None:
    """`env`: the launcher's environment (by default this process's)."""
    subprocess.run(_command(workdir, num_workers, 0, extra_args), cwd=ROOT, check=True, capture_output=True,
                   timeout=300, env=env)


def run_with_kill(workdir: str, num_workers: int, kill_step: int, rng: random.Random,
                  extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs under the launcher (1 restart allowed) and SIGKILLs a random worker once the
    chief logs a step >= kill_step; returns (launcher exit code, its output)."""
    proc = subprocess.Popen(_command(workdir, num_workers, 1, extra_args), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    output, killed = [], False
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        output.append(line)
        step = re.search(r"step (\d+)/", line)
        if not killed and step and int(step[1]) >= kill_step:
            # The workers the launcher says it started (the latest attempt's).
            workers = re.findall(r"started worker \d+ \(pid (\d+)\)", "".join(output))[-num_workers:]
            os.kill(int(rng.choice(workers)), signal.SIGKILL)
            killed = True
        if time.monotonic() > deadline:
            proc.kill()
    code = proc.wait(timeout=60)
    return (code if killed else -1), "".join(output)


def trial(base: str, reference: dict[str, np.ndarray], num_workers: int, rng: random.Random,
          extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> tuple[int, bool]:
    """One kill-and-compare trial (`extra_args`: more config overrides, as the reference ran with);
    returns (kill step, bitwise equal)."""
    kill_step = rng.randrange(10, TOTAL_STEPS - 10)
    workdir = tempfile.mkdtemp(dir=base)
    code, output = run_with_kill(workdir, num_workers, kill_step, rng, extra_args, env)
    if code != 0 or "restart 1/1" not in output:
        raise RuntimeError(f"trial killed at step {kill_step} ended with {code}:\n{output[-3000:]}")
    state = final_state(workdir)
    return kill_step, state.keys() == reference.keys() and all(
        np.array_equal(state[k], reference[k]) for k in reference)


FLAGS = flags.FLAGS
flags.DEFINE_integer("trials", 10, "Kill-and-compare trials.")
flags.DEFINE_integer("num_workers", 2, "Workers per run.")
flags.DEFINE_integer("seed", 0, "Seed for the kill steps and the killed worker.")


def main(argv: list[str]) -> None:
    del argv
    os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:9")  # no GCE probe from the preemption handler
    rng = random.Random(FLAGS.seed)
    with tempfile.TemporaryDirectory() as base:
        reference_dir = os.path.join(base, "reference")
        run_uninterrupted(reference_dir, FLAGS.num_workers)
        reference = final_state(reference_dir)
        equal = 0
        for i in range(FLAGS.trials):
            kill_step, same = trial(base, reference, FLAGS.num_workers, rng)
            equal += same
            print(f"trial {i + 1}: SIGKILL at step >= {kill_step}, resumed, bitwise equal: {same}", flush=True)
        print(f"{FLAGS.trials} trials, {equal} bitwise equal")


if __name__ == "__main__":
    app.run(main)
