"""SIGKILL during asynchronous checkpoint writes (config.train.async_checkpoint=True), then a rerun.

    python -m tests.stress.async_kill --trials=20

Each trial starts a small real run (`python -m mwloop.main`, an MLP with a few MB of state, a checkpoint every loop
call), watches its checkpoints directory for a write in flight (TensorFlow writes into `ckpt-N_temp/` and writes
`ckpt-N.index` last), SIGKILLs the process a random 0-10 ms into a random write, checks what is on disk
(TensorFlow's `checkpoint` pointer names a complete checkpoint, the newest or, killed between the files and the
manager's record, the one before; every `ckpt-N.index` is fully readable), reruns the command to the end and
compares the final checkpoint bitwise with an uninterrupted run's. Prints one line per trial and `N trials, M
bitwise equal`. Not part of the default suite; tests/test_async_checkpoint.py runs one trial (slow).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from mwloop.artifacts import files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOTAL_STEPS = 200
# configs/mlp.py with these settings (the command line's --config.KEY=VALUE; tests train the same run in-process).
SETTINGS = {"train.steps": TOTAL_STEPS, "train.steps_per_loop": 10, "train.log_every_steps": 10,
            "train.checkpoint_every_steps": 10, "train.eval_every_steps": 0, "model.hidden": (1024, 1024),
            "train.max_to_keep": 2, "train.async_checkpoint": True, "deterministic": True, "export": False}
RUN_ARGS = ["--config=configs/mlp.py", "--mode=train", *(f"--config.{k}={v}" for k, v in SETTINGS.items())]


def _command(workdir: str) -> list[str]:
    return [sys.executable, "-m", "mwloop.main", *RUN_ARGS, f"--workdir={workdir}"]


def _env() -> dict[str, str]:
    return {**os.environ, "GCE_METADATA_IP": "127.0.0.1:9", "CUDA_VISIBLE_DEVICES": ""}


def final_state(workdir: str) -> dict[str, np.ndarray]:
    """Every model, optimizer and step tensor of the final checkpoint."""
    reader = tf.train.load_checkpoint(os.path.join(workdir, "checkpoints", f"ckpt-{TOTAL_STEPS}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()
            if name.startswith(("model/", "optimizer/", "step/"))}


def run_to_the_end(workdir: str) -> str:
    """Runs (or reruns) the command to the end; returns its output."""
    done = subprocess.run(_command(workdir), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the run in {workdir} ended with {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stderr + done.stdout


def kill_during_a_write(workdir: str, rng: random.Random) -> tuple[int, bool]:
    """Starts the run and SIGKILLs it a random 0-10 ms into the write of a random checkpoint; returns (the
    checkpoint's step, whether its write was still in flight when the kill landed)."""
    target = rng.randrange(20, TOTAL_STEPS - 10, 10)  # the first is written before the loop is warm
    directory = os.path.join(workdir, "checkpoints")
    proc = subprocess.Popen(_command(workdir), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    try:
        while not os.path.exists(os.path.join(directory, f"ckpt-{target}_temp")):
            if os.path.exists(os.path.join(directory, f"ckpt-{target}.index")) and target < TOTAL_STEPS - 10:
                target += 10  # its write was over between two looks: take the next one
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended (code {proc.returncode}) before writing ckpt-{target}")
            time.sleep(0.0005)
        time.sleep(rng.uniform(0, 0.01))
        in_flight = not os.path.exists(os.path.join(directory, f"ckpt-{target}.index"))
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    return target, in_flight


def check_on_disk(workdir: str) -> int | None:
    """What a rerun finds: TensorFlow's pointer (`model_checkpoint_path`) and every `ckpt-N.index` name complete,
    readable checkpoints (mwloop resumes from the newest index); the state file's list may still name an older one
    the rotation had just deleted (TensorFlow's manager deletes, then rewrites the list; synchronous saves leave the
    same, and mwloop rewrites the file from the files found before its first save). Returns the newest step (None:
    none yet). Raises AssertionError otherwise."""
    directory = os.path.join(workdir, "checkpoints")
    found = sorted(int(m[1]) for name in os.listdir(directory) if (m := re.fullmatch(r"ckpt-(\d+)\.index", name))) \
        if os.path.isdir(directory) else []
    state = tf.train.get_checkpoint_state(directory)
    if state is not None:
        pointer = state.model_checkpoint_path
        pointer = pointer if os.path.isabs(pointer) else os.path.join(directory, pointer)
        assert os.path.exists(pointer + ".index"), f"the pointer names {pointer}, which is missing"
        # It may lag by one: a kill after the files, before the manager's callback, leaves the newest complete
        # checkpoint not yet named (never the other way round).
        assert files.checkpoint_step(pointer) in found[-2:], f"the pointer names {pointer}; found {found}"
        for listed in state.all_model_checkpoint_paths:
            assert os.path.exists(listed + ".index") or files.checkpoint_step(listed) < found[0], (
                f"the state file lists {listed}, missing and newer than the oldest checkpoint")
    for step in found:
        reader = tf.train.load_checkpoint(os.path.join(directory, f"ckpt-{step}"))
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)  # reads every tensor: a partial data file fails here
    return found[-1] if found else None


def trial(base: str, reference: dict[str, np.ndarray], rng: random.Random) -> tuple[int, bool, int | None, bool]:
    """One kill-check-rerun-compare trial; returns (step written when killed, whether the kill landed mid-write,
    the step the rerun resumed from, bitwise equal)."""
    workdir = tempfile.mkdtemp(dir=base)
    target, in_flight = kill_during_a_write(workdir, rng)
    newest = check_on_disk(workdir)
    output = run_to_the_end(workdir)
    resumed = re.search(r"resumed from step (\d+)", output)
    assert (int(resumed[1]) if resumed else None) == newest, f"resumed from {resumed and resumed[1]}, newest {newest}"
    state = final_state(workdir)
    same = state.keys() == reference.keys() and all(np.array_equal(state[k], reference[k]) for k in reference)
    return target, in_flight, newest, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="kill-check-rerun trials")
    parser.add_argument("--seed", type=int, default=0, help="seed of the checkpoint killed and the delay into it")
    args = parser.parse_args()  # argparse, not absl flags: tests import this module beside reliability's flags
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as base:
        reference_dir = os.path.join(base, "reference")
        run_to_the_end(reference_dir)
        reference = final_state(reference_dir)
        equal = mid_write = 0
        for i in range(args.trials):
            target, in_flight, resumed, same = trial(base, reference, rng)
            equal, mid_write = equal + same, mid_write + in_flight
            print(f"trial {i + 1}: SIGKILL during the write of ckpt-{target} (still in flight: {in_flight}), "
                  f"rerun resumed from {resumed}, bitwise equal: {same}", flush=True)
        print(f"{args.trials} trials ({mid_write} killed mid-write), {equal} bitwise equal")


if __name__ == "__main__":
    main()
