"""ResNet training throughput on the same generated JPEGs, fed by records by global index vs today's TFRecords.

    python -m benchmarks.records_train [--images=512 --image_size=128 --steps=30 --rounds=2]

Converts `images` photo-like 256x256 JPEGs (benchmarks.input_pipeline.fake_jpegs) both ways, then trains the
ImageNet recipe (configs/resnet.py, mixed_bfloat16, label smoothing, SGD) at a reduced size, once per variant
per round in an order rotated every round, in this process (one strategy, the default):

- records: `configs/resnet.py:imagenet_records` (dataset.name="records": train_records, global-index stream);
- tfrecord: `configs/resnet.py:imagenet` (today's interleaved files and block shuffle).

Reports examples/s of the train loop after its first log window (that one holds the trace): the Trainer's own
`examples_per_sec` (the steps' time, the input included), median over rounds, and the per-round ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import mwloop  # noqa: E402
from benchmarks.input_pipeline import fake_jpegs  # noqa: E402
from benchmarks.records_speed import write_folders  # noqa: E402
from mwloop.config import base as config_base  # noqa: E402
from mwloop.data import convert, make_tfrecords  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(variant: str, data_dir: str, image_size: int, steps: int):
    """The recipe of `variant` at a size that trains on 2 CPU cores: a ResNet of 4 stages of one block."""
    return config_base.load(os.path.join(ROOT, "configs", "resnet.py"), variant, {
        "dataset.data_dir": data_dir, "dataset.image_size": image_size, "dataset.num_classes": 2,
        "model.blocks": (1, 1, 1, 1), "model.width": 16, "train.global_batch_size": 32, "train.steps": steps,
        "train.steps_per_loop": 10, "train.log_every_steps": 10, "train.eval_every_steps": 0,
        "train.checkpoint_every_steps": 0, "optimizer.warmup_steps": 2, "distribution.strategy": "default",
        "export": False}, check=False)


def throughput(cfg, workdir: str) -> float:
    """Examples/s of the train windows after the first (the trace), as the Trainer logs them."""
    rates = []

    class Rates(mwloop.Action):
        # After the Log action of the same step (the caller's actions run after the built-in ones).
        every_steps = 10

        def __call__(self, run, step):
            if step > 10:
                rates.append(run.metrics["train"]["examples_per_sec"])

    with mwloop.Trainer(cfg, workdir, actions=[Rates()], evaluate=False) as trainer:
        trainer.train()
    return statistics.mean(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--image_size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        images = write_folders(root, fake_jpegs(args.images, 256))
        convert.convert(images, os.path.join(root, "records"), validation_fraction=0.05, progress=False)
        make_tfrecords.convert(images, os.path.join(root, "tfrecords"), shards=8, label_offset=1, progress=False)
        variants = {"records": ("imagenet_records", os.path.join(root, "records")),
                    "tfrecord": ("imagenet", os.path.join(root, "tfrecords"))}
        names = list(variants)
        rates: dict[str, list[float]] = {name: [] for name in names}
        for round_number in range(args.rounds):
            for name in names[round_number % 2:] + names[:round_number % 2]:
                variant, data_dir = variants[name]
                cfg = config(variant, data_dir, args.image_size, args.steps)
                rates[name].append(throughput(cfg, os.path.join(root, f"run-{name}-{round_number}")))
                print(f"round {round_number} {name}: {rates[name][-1]:.1f} examples/s", flush=True)
    ratios = [r / t for r, t in zip(rates["records"], rates["tfrecord"])]
    print(f"ResNet (4 stages x 1 block, width 16) at {args.image_size}px, batch 32, {args.rounds} rounds; load "
          f"{os.getloadavg()[0]:.1f}")
    for name in names:
        print(f"  {name:9s} median {statistics.median(rates[name]):6.1f} examples/s "
              f"({', '.join(f'{v:.1f}' for v in rates[name])})")
    print(f"  records / tfrecord: {statistics.median(ratios):.2f} ({', '.join(f'{v:.2f}' for v in ratios)})")


if __name__ == "__main__":
    main()
