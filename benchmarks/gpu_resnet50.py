"""ResNet-50 on synthetic ImageNet-shaped data on one GPU: mwloop against Keras model.fit, bf16 + XLA.

    python -m benchmarks.gpu_resnet50            # the GPU run: batch 256, 224x224x3, 1000 classes (< 8 min)
    python -m benchmarks.gpu_resnet50 --smoke    # runs anywhere (CPU): batch 4, 32x32x3, a few steps

The model is `configs/resnet.py:synthetic` (ResNet-50, 1000 classes) with
config.mixed_precision="mixed_bfloat16" (the global Keras policy; logits and
loss stay float32) and XLA for the forward and backward pass
(config.jit_compile=True for mwloop, `compile(jit_compile=True)` for fit).
All peers live in this one process (one GPU, one TF allocator), each with
its own model and optimizer, built in turn (the first call traces and
XLA-compiles); then one warm-up window each, then `--rounds` rounds, in each
of which every peer runs one window of `--window_steps` steps in a rotated
order.
images/s = global batch / median step time; a ratio is the median over
rounds of the per-round ratio (as benchmarks/throughput.py reports them).

Peers (builders from benchmarks/peers.py where they fit):
- mwloop: a `mwloop.Trainer` (config.jit_compile=True; its loop and actions), fed by
  `feed.ResidentFeed` (the training arrays stay on the GPU: no host-to-device
  copy per step; what train.py runs for in-memory sources);
- mwloop (tf.data iterator): the same loop fed by a tf.data iterator
  (config.train.feed="iterator": every batch crosses from the host);
- fit: `model.fit(steps_per_execution=K)` compiled with jit_compile=True on
  the same tf.data global batches (one fit call per window).

Without a visible GPU (and without --smoke) it exits with code 2 and says so.
A time guard stops adding rounds once --budget_s is spent (at least 2 rounds).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PEERS = ("mwloop", "fit", "mwloop (tf.data iterator)")
POLICY = "mixed_bfloat16"


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-sized run: proves the script works")
    # Defaults: GPU run / --smoke; a value given on the command line wins in both.
    parser.add_argument("--batch", type=int, help="global batch (256 / smoke 4)")
    parser.add_argument("--image_size", type=int, help="224 / smoke 32")
    parser.add_argument("--steps_per_loop", type=int, help="K: steps per call / steps_per_execution (50 / smoke 2)")
    parser.add_argument("--window_steps", type=int, help="steps per timed window, a multiple of K (100 / smoke 4)")
    parser.add_argument("--rounds", type=int, help="timed rounds (5 / smoke 2)")
    parser.add_argument("--num_train_examples", type=int, help="distinct synthetic examples (1024 / smoke 16)")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--no_xla", action="store_true", help="jit_compile off for every peer")
    parser.add_argument("--budget_s", type=float, default=420.0, help="no new round after this many seconds")
    parser.add_argument("--json", default="", help="also write the results to this file")
    args = parser.parse_args(argv)
    defaults = ({"batch": 4, "image_size": 32, "steps_per_loop": 2, "window_steps": 4, "rounds": 2,
                 "num_train_examples": 16} if args.smoke else
                {"batch": 256, "image_size": 224, "steps_per_loop": 50, "window_steps": 100, "rounds": 5,
                 "num_train_examples": 1024})
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.window_steps % args.steps_per_loop:
        parser.error(f"--window_steps={args.window_steps} must be a multiple of --steps_per_loop={args.steps_per_loop}")
    for name in args.peers.split(","):
        if name not in PEERS:
            parser.error(f"--peers: unknown peer {name!r}; use some of {', '.join(PEERS)}")
    return args


def make_setup(args):
    """A benchmarks.peers.Setup for ResNet-50 synthetic at the requested size, default strategy (one GPU)."""
    import tensorflow as tf

    from benchmarks import peers
    from mwloop.tasks.classification import ImageClassification

    class Setup(peers.Setup):
        def __init__(self):  # noqa: D401 -- the parent's fields, another config
            self.strategy = tf.distribute.get_strategy()
            self.config = peers.load_config("resnet50")
            self.config.update_from_flattened_dict({
                "dataset.image_shape": (args.image_size, args.image_size, 3),
                "dataset.num_train_examples": args.num_train_examples,
                "dataset.num_eval_examples": args.batch,
                "train.global_batch_size": args.batch, "train.steps_per_loop": args.steps_per_loop,
                "mixed_precision": POLICY, "jit_compile": not args.no_xla})
            self.task = ImageClassification(self.config)
            self.source = self.task.source
            self.global_batch_size = args.batch
            self.steps_per_loop = args.steps_per_loop
    return Setup()


def build_fit(s, jit_compile: bool):
    """Keras model.fit(steps_per_execution=K, jit_compile=...) on the same tf.data global batches."""
    import keras
    import tensorflow as tf
    keras.mixed_precision.set_global_policy(POLICY)
    model, optimizer = s.model_and_optimizer()
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], steps_per_execution=s.steps_per_loop, jit_compile=jit_compile)
    dataset = s.dataset_fn()(tf.distribute.InputContext()).map(lambda b: (b["image"], b["label"]))

    def window(num_steps: int) -> None:
        model.fit(dataset, epochs=1, steps_per_epoch=num_steps, verbose=0)
    return lambda: window(s.steps_per_loop), window


def describe_gpu() -> str:
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "CPU only"
    details = tf.config.experimental.get_device_details(gpus[0])
    return (f"{len(gpus)} GPU(s), using GPU:0 = {details.get('device_name', '?')} "
            f"(compute {details.get('compute_capability')})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    import tensorflow as tf
    if not tf.config.list_physical_devices("GPU") and not args.smoke:
        print("gpu_resnet50: no GPU visible to TensorFlow (tf.config.list_physical_devices('GPU') is empty); "
              "nothing measured. Run on a GPU machine, or pass --smoke to check the script on the CPU.",
              file=sys.stderr)
        return 2
    import keras

    from benchmarks import peers
    device = describe_gpu()
    xla = not args.no_xla
    print(f"# ResNet-50 synthetic {args.image_size}x{args.image_size}x3, 1000 classes, batch {args.batch}, "
          f"K={args.steps_per_loop}, {POLICY}, XLA {'on' if xla else 'off'}; {device}; TF {tf.__version__}, "
          f"Keras {keras.__version__}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
          f"{' (SMOKE: not a measurement)' if args.smoke else ''}", flush=True)
    s = make_setup(args)
    builders = {
        "mwloop": functools.partial(peers.build_mwloop, jit_compile=xla, mixed_precision=POLICY),
        "mwloop (tf.data iterator)": functools.partial(peers.build_mwloop, feed_kind="iterator", jit_compile=xla,
                                                       mixed_precision=POLICY),
        "fit": functools.partial(build_fit, jit_compile=xla),
    }
    names = args.peers.split(",")
    windows, first_s, warm_s, errors = {}, {}, {}, {}
    for name in names:
        t = time.perf_counter()
        try:
            first_call, window = builders[name](s)
            first_call()  # traces and XLA-compiles
            first_s[name] = time.perf_counter() - t
            windows[name] = window
        except Exception as e:  # a failing peer is a result
            errors[name] = f"{type(e).__name__}: {peers._gist(str(e))}"
        print(f"  built {name}: first call {first_s.get(name, float('nan')):.1f} s"
              f"{' -- ' + errors[name] if name in errors else ''}", file=sys.stderr, flush=True)
    live = [n for n in names if n in windows]
    for name in list(live):  # one warm-up window each, once every peer is built
        t = time.perf_counter()
        try:
            windows[name](args.window_steps)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {peers._gist(str(e))}"
            live.remove(name)
        warm_s[name] = time.perf_counter() - t
        print(f"  warm-up {name}: {warm_s[name]:.2f} s{' -- ' + errors[name] if name in errors else ''}",
              file=sys.stderr, flush=True)
    elapsed: dict[str, list[float]] = {n: [] for n in live}
    for r in range(args.rounds):
        if r >= 2 and time.perf_counter() - t_start > args.budget_s:
            print(f"  time guard: stopping after {r} rounds", file=sys.stderr)
            break
        for name in live[r % len(live):] + live[:r % len(live)]:
            t = time.perf_counter()
            windows[name](args.window_steps)
            elapsed[name].append(time.perf_counter() - t)
        print(f"  round {r + 1}: " + ", ".join(f"{n} {args.batch * args.window_steps / elapsed[n][-1]:,.0f} img/s"
                                               for n in live), file=sys.stderr, flush=True)

    def ratio(a: str, b: str) -> float | None:
        if a not in elapsed or b not in elapsed:
            return None
        return statistics.median(tb / ta for ta, tb in zip(elapsed[a], elapsed[b]))

    rows = []
    print("\n| peer | images/s | vs mwloop | vs fit | first call (s) | rounds |\n|---|---:|---:|---:|---:|---:|")
    for name in names:
        if name in errors:
            print(f"| {name} | fails: {errors[name]} | | | | |")
            rows.append({"peer": name, "error": errors[name]})
            continue
        ips = args.batch * args.window_steps / statistics.median(elapsed[name])
        vs_m, vs_f = ratio(name, "mwloop"), ratio(name, "fit")
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"| {name} | {ips:,.0f} | {fmt(vs_m)} | {fmt(vs_f)} | {first_s[name]:.1f} | {len(elapsed[name])} |")
        rows.append({"peer": name, "images_per_sec": ips, "vs_mwloop": vs_m, "vs_fit": vs_f,
                     "first_call_s": first_s[name], "window_s": elapsed[name]})
    if "mwloop" in elapsed and not args.smoke:
        ips = args.batch * args.window_steps / statistics.median(elapsed["mwloop"])
        print(f"\nmwloop: {ips:,.0f} images/s; issue 6 target on an H200 >= 4,500 "
              f"({'met' if ips >= 4500 else 'missed'}); NVIDIA's A100 40GB reference (AMP + XLA, batch 256): 2,375")
    total = time.perf_counter() - t_start
    print(f"({total:.0f} s; `python -m benchmarks.gpu_resnet50 {' '.join(sys.argv[1:] if argv is None else argv)}`)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "args": vars(args), "rows": rows, "total_s": total}, f, indent=1)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
