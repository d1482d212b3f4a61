"""Elastic training: what a lost worker costs and whether the result stays the same.

    python -m benchmarks.elastic [--steps=3000] [--kill_at=700]

Three real local jobs of configs/mlp.py (deterministic, global batch 48, a checkpoint every 500 steps):

- `uninterrupted`: 3 workers from start to end (`--num_workers=3`);
- `elastic`: `--num_workers=2:3 --rejoin_s=inf`, worker 2 SIGKILLed for good at step `kill_at` (between
  checkpoints): the job re-forms with 2 and finishes;
- `resumed`: 2 workers started from a copy of the elastic job's checkpoint before the kill (what a user
  would get by restarting by hand with 2).

Prints the max relative difference of the final weights between each pair (and whether they are bitwise
equal), the seconds from the kill to training again, and the examples/s before and after the change (medians of
metrics.jsonl's train events).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import tensorflow as tf

from mwloop.artifacts import files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command(workdir: str, bounds: str, steps: int, *launcher_flags: str) -> list[str]:
    overrides = {"train.steps": steps, "train.global_batch_size": 48, "eval.global_batch_size": 96,
                 "train.checkpoint_every_steps": 500, "train.max_to_keep": 10, "deterministic": True}
    return [sys.executable, "-m", "mwloop.launch", f"--num_workers={bounds}", *launcher_flags, "--",
            "--config=configs/mlp.py", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]


def _run(command: list[str], kill: tuple[int, int] | None = None) -> None:
    """Runs a launcher to its end; with kill=(worker, step) SIGKILLs that worker once the chief logs the step."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", GCE_METADATA_IP="127.0.0.1:9")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    killed = False
    while kill and not killed and proc.poll() is None:
        text = "".join(lines)
        pid = re.search(rf"started worker {kill[0]} \(pid (\d+)\)", text)
        if pid and re.search(rf"\[worker 0\] .*step {kill[1]}/", text):
            os.kill(int(pid[1]), signal.SIGKILL)
            killed = True
        time.sleep(0.02)
    if proc.wait(timeout=900) != 0:
        raise SystemExit(f"{command} exited with {proc.returncode}:\n{''.join(lines)[-3000:]}")
    reader.join(timeout=10)


def _weights(workdir: str, step: int) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(os.path.join(workdir, files.CHECKPOINTS, f"ckpt-{step}"))
    values = {name: np.asarray(reader.get_tensor(name)) for name in reader.get_variable_to_shape_map()}
    return {name: v for name, v in values.items() if v.ndim and v.dtype.kind == "f"}


def _difference(a: str, b: str, step: int) -> tuple[float, bool]:
    wa, wb = _weights(a, step), _weights(b, step)
    worst = max(float(np.max(np.abs(wa[k] - wb[k])) / (np.max(np.abs(wb[k])) + 1e-12)) for k in wa)
    return worst, all(np.array_equal(wa[k], wb[k]) for k in wa)


def _speed(workdir: str, low: int, high: int) -> float:
    """Median examples/s of the train events with low < step <= high (the first of each round left out)."""
    events = [e for e in files.read_metrics(workdir) if e["split"] == "train" and low < e["step"] <= high]
    return statistics.median(e["examples_per_sec"] for e in events[1:]) if len(events) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--kill_at", type=int, default=700)
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="mwloop-elastic-bench-")
    uninterrupted, elastic, resumed = (os.path.join(base, name) for name in ("uninterrupted", "elastic", "resumed"))
    _run(_command(uninterrupted, "3", args.steps, "--max_restarts=0"))
    _run(_command(elastic, "2:3", args.steps, "--rejoin_s=inf"), kill=(2, args.kill_at))
    membership = [e for e in files.read_metrics(elastic) if e["split"] == "membership"]
    resume_step = membership[0]["step"]
    os.makedirs(os.path.join(resumed, files.CHECKPOINTS))
    copied = [shutil.copy(os.path.join(elastic, files.CHECKPOINTS, path), os.path.join(resumed, files.CHECKPOINTS))
              for path in os.listdir(os.path.join(elastic, files.CHECKPOINTS)) if path.startswith(f"ckpt-{resume_step}.")]
    assert copied, f"ckpt-{resume_step} is gone from {elastic}"
    _run(_command(resumed, "2", args.steps, "--max_restarts=0"))
    print(f"elastic training, configs/mlp.py, {args.steps} steps, global batch 48, deterministic; worker 2 of 3 "
          f"SIGKILLed at step {args.kill_at}, resumed from ckpt-{resume_step}")
    for a, b in (("elastic", "uninterrupted"), ("elastic", "resumed"), ("resumed", "uninterrupted")):
        worst, bitwise = _difference(os.path.join(base, a), os.path.join(base, b), args.steps)
        print(f"  final weights {a} vs {b}: max relative difference {worst:.2e}{' (bitwise equal)' if bitwise else ''}")
    print(f"  kill -> training again: {membership[0]['seconds_lost']:.1f} s (membership event); "
          f"{membership[0]['steps_redone']} steps trained again")
    before, after = _speed(elastic, 0, args.kill_at), _speed(elastic, resume_step + 100, args.steps)
    print(f"  examples/s: 3 workers {before:,.0f}, 2 workers {after:,.0f} (ratio {after / before:.2f}); "
          f"uninterrupted 3 workers {_speed(uninterrupted, 0, args.steps):,.0f}")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
