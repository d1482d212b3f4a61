"""Elastic training: what a lost worker costs and whether the result stays the same.

    python -m benchmarks.elastic [--steps=3000] [--kill_at=700] [--checkpoint_every=500] [--records | --images]
        [--rdzv] [--batch_norm=sync|local] [--precision=float32|mixed_bfloat16]

Three real local jobs of configs/mlp.py (deterministic, global batch 48, a checkpoint every 500 steps):

- `uninterrupted`: 3 workers from start to end (`--num_workers=3`);
- `elastic`: `--num_workers=2:3 --rejoin_s=inf`, worker 2 SIGKILLed for good at step `kill_at` (between
  checkpoints): the job re-forms with 2 and finishes;
- `resumed`: 2 workers started from a copy of the elastic job's checkpoint before the kill (what a user
  would get by restarting by hand with 2).

Prints the max relative difference of the final weights between each pair (and whether they are bitwise
equal), the seconds from the kill to training again, and the examples/s before and after the change (medians of
metrics.jsonl's train events). Then the stories (`--parts=stories`): a kill and the place back after
`--rejoin_s=20` (shrink, grow); a SIGTERM to worker 1 (notice: the step saved and the step resumed from), then
the new chief SIGKILLed (a lost chief); each change's seconds lost and each round's examples/s.

`--records`: the exact part on tests/records_task.py's arrays written by the converter; `--images`: on generated
JPEGs of 4 classes written by the converter, trained by the ImageNet recipe on records
(configs/resnet.py:imagenet_records) at 32x32 with a ResNet of 2 stages of one block, width 8, with synchronized
batch normalization in float32 (`--batch_norm=local`, `--precision=mixed_bfloat16` for the other settings). The
weights are compared at the first checkpoint after the re-form (before rounding drift grows) and at the end.
`--rdzv`: the elastic job as 3 agents (`mwloop.launch --rdzv=etcd://...`) meeting in a real etcd on 127.0.0.1
(tests/services/etcd.py), a machine (agent and worker) SIGKILLed instead of a worker.
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


# --images: the ImageNet recipe on records at a size that trains on 2 shared cores, as a config file (a tuple such
# as model.blocks cannot be set by a --config.KEY flag).
IMAGES_CONFIG = """from mwloop.config import base


def get_config(arg=None):
    return base.load({resnet!r}, "imagenet_records", {{
        "dataset.data_dir": {data!r}, "dataset.image_size": 32, "dataset.num_classes": 0, "model.blocks": (1, 1),
        "model.width": 8, "optimizer.warmup_steps": 20, "train.steps_per_loop": 10, "train.log_every_steps": 10,
        "train.eval_every_steps": 0, "export": False, "model.sync_batch_norm": {sync!r},
        "mixed_precision": {precision!r}}}, check=False)
"""


def _command(workdir: str, bounds: str, steps: int, *launcher_flags: str, config: str = "configs/mlp.py",
             checkpoint_every: int = 500) -> list[str]:
    # Every checkpoint kept: the comparison reads the first one after the re-form as well as the last.
    overrides = {"train.steps": steps, "train.global_batch_size": 48, "eval.global_batch_size": 96,
                 "train.checkpoint_every_steps": checkpoint_every,
                 "train.max_to_keep": steps // checkpoint_every + 2, "deterministic": True}
    return [sys.executable, "-m", "mwloop.launch", f"--num_workers={bounds}", *launcher_flags, "--",
            f"--config={config}", f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]


def _run(command: list[str], *signals: tuple[int, int, int, int]) -> str:
    """Runs a launcher to its end and returns its output. Each of `signals`, (signal, worker, start, step): sends
    the signal to the `start`-th start (0-based) of that worker once the chief has logged `step` after it."""
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", GCE_METADATA_IP="127.0.0.1:9")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    pending = list(signals)
    while pending and proc.poll() is None:
        signum, worker, start, step = pending[0]
        text = "".join(lines)
        starts = list(re.finditer(rf"started worker {worker} \(pid (\d+)\)", text))
        if len(starts) > start and re.search(rf"\[worker 0\] .*step {step}/", text[starts[start].end():]):
            os.kill(int(starts[start][1]), signum)
            pending.pop(0)
        time.sleep(0.02)
    if proc.wait(timeout=900) != 0:
        raise SystemExit(f"{command} exited with {proc.returncode}:\n{''.join(lines)[-3000:]}")
    reader.join(timeout=10)
    return "".join(lines)


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
    parser.add_argument("--parts", default="exact,stories", help="exact: the three jobs compared; stories: grow, "
                        "notice and a lost chief")
    parser.add_argument("--checkpoint_every", type=int, default=500)
    parser.add_argument("--records", action="store_true", help="exact part on records on disk (tests/records_task.py, "
                        "a dataset written by python -m mwloop.data.convert) instead of configs/mlp.py's arrays")
    parser.add_argument("--images", action="store_true", help="exact part on generated JPEGs written by python -m "
                        "mwloop.data.convert, trained by configs/resnet.py:imagenet_records at 32x32")
    parser.add_argument("--rdzv", action="store_true", help="exact part: the elastic job as 3 agents "
                        "(mwloop.launch --rdzv) meeting in a real etcd on 127.0.0.1, one worker each; the machine of "
                        "worker 2 (its agent and worker) SIGKILLed at kill_at")
    parser.add_argument("--batch_norm", choices=("sync", "local"), default="sync", help="--images: synchronized "
                        "batch normalization (statistics of the global batch: the same math at any worker count) or "
                        "each replica's own batch")
    parser.add_argument("--precision", default="float32", help="--images: mixed_precision (float32: equality to "
                        "rounding is visible; mixed_bfloat16 rounds each activation to 8 bits of mantissa)")
    args = parser.parse_args()
    base = tempfile.mkdtemp(prefix="mwloop-elastic-bench-")
    args.config = "configs/mlp.py"
    if args.records:
        from tests import records_task
        args.config = f"tests/records_task.py:{records_task.write_records(os.path.join(base, 'data'))}"
    if args.images:
        from mwloop.data import convert
        from tests.image_folders import make_fake_image_folders
        make_fake_image_folders(os.path.join(base, "images"), num_classes=4, per_class=60, size=40)
        convert.convert(os.path.join(base, "images"), os.path.join(base, "data"), validation_fraction=0.2,
                        progress=False)
        args.config = os.path.join(base, "images_config.py")
        with open(args.config, "w") as f:
            f.write(IMAGES_CONFIG.format(resnet=os.path.join(ROOT, "configs", "resnet.py"),
                                         data=os.path.join(base, "data"), sync=args.batch_norm == "sync",
                                         precision=args.precision))
    if "exact" in args.parts:
        _exact(base, args)
    if "stories" in args.parts:
        _stories(base, args)
    shutil.rmtree(base, ignore_errors=True)


def _exact(base: str, args: argparse.Namespace) -> None:
    """The elastic job against an uninterrupted one and a by-hand restart with 2 workers."""
    uninterrupted, elastic, resumed = (os.path.join(base, name) for name in ("uninterrupted", "elastic", "resumed"))
    job = {"config": args.config, "checkpoint_every": args.checkpoint_every}
    _run(_command(uninterrupted, "3", args.steps, "--max_restarts=0", **job))
    if args.rdzv:
        _agents(elastic, args, job)
    else:
        _run(_command(elastic, "2:3", args.steps, "--rejoin_s=inf", **job), (signal.SIGKILL, 2, 0, args.kill_at))
    membership = [e for e in files.read_metrics(elastic) if e["split"] == "membership"]
    resume_step = membership[0]["step"]
    os.makedirs(os.path.join(resumed, files.CHECKPOINTS))
    saved = os.path.join(elastic, files.CHECKPOINTS)
    copied = [shutil.copy(os.path.join(saved, path), os.path.join(resumed, files.CHECKPOINTS))
              for path in os.listdir(saved) if path.startswith(f"ckpt-{resume_step}.")]
    assert copied, f"ckpt-{resume_step} is gone from {elastic}"
    _run(_command(resumed, "2", args.steps, "--max_restarts=0", **job))
    print(f"elastic training, {args.config}, {args.steps} steps, global batch 48, deterministic; worker 2 of 3 "
          f"SIGKILLed at step {args.kill_at}, resumed from ckpt-{resume_step}")
    _compare(base, resume_step, args)
    print(f"  kill -> training again: {membership[0]['seconds_lost']:.1f} s (membership event); "
          f"{membership[0]['steps_redone']} steps trained again")
    # After the re-form's compile: 100 steps later, or half-way to the end of a short run.
    settled = resume_step + min(100, (args.steps - resume_step) // 2)
    before, after = _speed(elastic, 0, args.kill_at), _speed(elastic, settled, args.steps)
    print(f"  examples/s: 3 workers {before:,.0f}, 2 workers {after:,.0f} (ratio {after / before:.2f}); "
          f"uninterrupted 3 workers {_speed(uninterrupted, 0, args.steps):,.0f}")


def _agents(workdir: str, args: argparse.Namespace, job: dict) -> None:
    """The elastic job as 3 agents of one worker each, meeting in a throwaway etcd (tests/services/etcd.py); once
    the chief has logged step `kill_at`, the agent that runs worker 2 is SIGKILLed with its worker (its process
    group: a machine lost). The other two re-form when its lease runs out and train to the end."""
    from tests.services import etcd
    server = etcd.start()
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", GCE_METADATA_IP="127.0.0.1:9")
    logs = {host: f"{workdir}-{host}.log" for host in ("h0", "h1", "h2")}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for host, log in logs.items():
            flags = (f"--rdzv={server.rendezvous_url('bench')}", f"--host_id={host}", "--rdzv_ttl_s=2", "--grace_s=5",
                     "--wait_for_min_s=120")
            with open(log, "w") as out:
                procs[host] = subprocess.Popen(_command(workdir, "2:3", args.steps, *flags, **job), cwd=ROOT, env=env,
                                               stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        text = lambda host: open(logs[host], errors="replace").read()  # noqa: E731
        deadline = time.monotonic() + 900
        while not any(re.search(rf"\[worker 0\] .*step {args.kill_at}/", text(host)) for host in logs):
            if time.monotonic() > deadline or any(proc.poll() is not None for proc in procs.values()):
                raise SystemExit(f"the agents did not reach step {args.kill_at}:\n" +
                                 "\n".join(text(host)[-2000:] for host in logs))
            time.sleep(0.05)
        [lost] = [host for host in logs if re.search(r"round \d+: 3 workers on .*runs workers 2\.\.2", text(host))]
        os.killpg(procs[lost].pid, signal.SIGKILL)
        for host, proc in procs.items():
            if host != lost and proc.wait(timeout=900) != 0:
                raise SystemExit(f"agent {host} exited with {proc.returncode}:\n{text(host)[-3000:]}")
        print(f"  agents: {lost} (worker 2) lost at step {args.kill_at}; "
              + "; ".join(sorted({m for host in logs for m in re.findall(r"membership: [^\n]*", text(host))})))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        server.stop()


def _compare(base: str, resume_step: int, args: argparse.Namespace) -> None:
    """Prints the three pairs' max relative difference at the first checkpoint after the re-form (before rounding
    drift grows) and at the end."""
    first_after = resume_step + args.checkpoint_every
    for step in sorted({min(first_after, args.steps), args.steps}):
        for a, b in (("elastic", "uninterrupted"), ("elastic", "resumed"), ("resumed", "uninterrupted")):
            worst, bitwise = _difference(os.path.join(base, a), os.path.join(base, b), step)
            print(f"  ckpt-{step} weights {a} vs {b}: max relative difference {worst:.2e}"
                  f"{' (bitwise equal)' if bitwise else ''}")


def _stories(base: str, args: argparse.Namespace) -> None:
    """Grow, notice and a lost chief: each change's cost and the examples/s of each round."""
    grow, notice = os.path.join(base, "grow"), os.path.join(base, "notice")
    _run(_command(grow, "2:3", args.steps, "--rejoin_s=20"), (signal.SIGKILL, 2, 0, args.kill_at))
    output = _run(_command(notice, "1:3", args.steps, "--rejoin_s=inf"), (signal.SIGTERM, 1, 0, args.kill_at),
                  (signal.SIGKILL, 0, 1, args.kill_at + 500))
    saved = re.findall(r"\[worker 0\] .*preempted: saving a checkpoint at step (\d+)", output)
    resumed = re.findall(r"\[worker 0\] .*resumed from step (\d+)", output)
    print(f"  notice: SIGTERM to worker 1 at step {args.kill_at}: saved at step {saved[0]}, the next round resumed "
          f"from step {resumed[0]}")
    for name, workdir in (("grow", grow), ("notice + lost chief", notice)):
        events = [e for e in files.read_metrics(workdir) if e["split"] == "membership"]
        bounds = [0] + [e["step"] for e in events] + [args.steps]
        rounds = [events[0]["workers_before"]] + [e["workers_after"] for e in events]
        speeds = ", ".join(f"{n} workers {_speed(workdir, low, high):,.0f}"
                           for n, low, high in zip(rounds, bounds, bounds[1:]))
        changes = "; ".join(f"{e['workers_before']} -> {e['workers_after']} from step {e['step']}: "
                            f"{e['seconds_lost']} s lost, {e['steps_redone']} steps again" for e in events)
        print(f"  {name}: {changes}\n    examples/s by round: {speeds}")


if __name__ == "__main__":
    main()
