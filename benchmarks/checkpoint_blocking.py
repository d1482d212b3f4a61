"""How long a checkpoint save blocks the training loop, synchronous against asynchronous (issue 32).

    python -m benchmarks.checkpoint_blocking [--saves=7] [--rounds=5] [--every=4] [--steps_per_round=16]

ResNet-50 on synthetic 224x224x3 images (`configs/resnet.py:synthetic`, batch 8, SGD momentum: ~205 MB of
weights and slots) on the CPU, three `mwloop.Trainer`s in one process: saves synchronous, saves asynchronous
(`train.async_checkpoint=True`), no saves.

Blocking: `Trainer.save` of the synchronous and the asynchronous trainer, alternating (which goes first
alternates too), `--saves` of each; the asynchronous write is then waited for (its background seconds are
reported, not counted as blocking). Medians.

Throughput: `--rounds` rounds; in each, every trainer trains `--steps_per_round` steps (`Trainer.train`, a save
every `--every` steps; the order rotates by round); per round the ratio of each trainer's steps/s to the
no-save trainer's, median over rounds. `train` returns only when its writes are complete, so each
asynchronous round also pays for its last write.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import tempfile
import time

STATE = {"sync": {"train.async_checkpoint": False}, "async": {"train.async_checkpoint": True},
         "none": {"train.async_checkpoint": False}}


def _config(every: int, overrides: dict):
    from mwloop.config import base as config_base
    return config_base.load_config("configs/resnet.py:synthetic", {
        "train.global_batch_size": 8, "train.steps_per_loop": 2, "dataset.num_train_examples": 16,
        "train.steps": 100_000, "train.log_every_steps": 0, "train.eval_every_steps": 0,
        "train.checkpoint_every_steps": every, "train.max_to_keep": 2, "export": False, "writers": (),
        "distribution.strategy": "default", **overrides})


def _state_mb(trainer) -> float:
    variables = [*trainer.state.model.weights, *trainer.state.optimizer.variables]
    return sum(v.numpy().nbytes for v in variables) / 1e6


def measure_blocking(trainers: dict, saves: int) -> dict[str, list[float]]:
    """Seconds `Trainer.save` blocks, by mode, and the asynchronous writes' background seconds."""
    out: dict[str, list[float]] = {"sync": [], "async": [], "async write": []}
    for i in range(saves):
        for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):
            trainer = trainers[mode]
            step = 1_000_000 + i
            started = time.perf_counter()
            trainer.save(step)
            out[mode].append(time.perf_counter() - started)
            if mode == "async":
                trainer.wait_for_checkpoints()
                out["async write"].append(time.perf_counter() - started)
    return out


def measure_throughput(trainers: dict, rounds: int, steps_per_round: int) -> dict[str, list[float]]:
    """Per round, each trainer's steps/s over the no-save trainer's."""
    modes = list(trainers)
    ratios: dict[str, list[float]] = {m: [] for m in modes if m != "none"}
    for r in range(rounds):
        rate = {}
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            trainer = trainers[mode]
            started = time.perf_counter()
            trainer.train(until_step=trainer.step + steps_per_round)
            rate[mode] = steps_per_round / (time.perf_counter() - started)
        for mode in ratios:
            ratios[mode].append(rate[mode] / rate["none"])
        print(f"round {r + 1}: steps/s " + ", ".join(f"{m} {rate[m]:.3f}" for m in modes), flush=True)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=4, help="steps between saves in the throughput rounds")
    parser.add_argument("--steps_per_round", type=int, default=16)
    args = parser.parse_args()
    import mwloop
    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    with tempfile.TemporaryDirectory() as base, contextlib.ExitStack() as stack:
        trainers = {}
        for mode, overrides in STATE.items():
            config = _config(args.every if mode != "none" else 0, overrides)
            trainers[mode] = stack.enter_context(mwloop.Trainer(config, os.path.join(base, mode), evaluate=False,
                                                                preemption=False))
            trainers[mode].train(until_step=2)  # traced and warm before anything is timed
        for step in (1, 2):  # the asynchronous copy function is traced at the second write: its one-time cost
            for mode in ("sync", "async"):
                started = time.perf_counter()
                trainers[mode].save(step)
                trainers[mode].wait_for_checkpoints()
                print(f"warm-up save {step} ({mode}): {time.perf_counter() - started:.3f} s", flush=True)
        print(f"state: {_state_mb(trainers['sync']):.0f} MB (weights and optimizer slots)", flush=True)
        blocked = measure_blocking(trainers, args.saves)
        sync, asyn = statistics.median(blocked["sync"]), statistics.median(blocked["async"])
        print("blocking per save (median of %d): sync %.3f s, async %.3f s (%.1f%% of sync); async write in "
              "the background %.3f s" % (args.saves, sync, asyn, 100 * asyn / sync,
                                         statistics.median(blocked["async write"])), flush=True)
        print("  sync " + " ".join(f"{s:.3f}" for s in blocked["sync"]), flush=True)
        print("  async " + " ".join(f"{s:.3f}" for s in blocked["async"]), flush=True)
        ratios = measure_throughput(trainers, args.rounds, args.steps_per_round)
        for mode, values in ratios.items():
            print(f"throughput with a save every {args.every} steps, {mode} / no saves: median "
                  f"{statistics.median(values):.3f} (rounds {' '.join(f'{v:.3f}' for v in values)})", flush=True)
        print("async / sync throughput: median %.3f" % statistics.median(
            [a / s for a, s in zip(ratios["async"], ratios["sync"], strict=True)]), flush=True)
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
