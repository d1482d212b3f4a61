"""Training throughput with the MLflow sink on and off, interleaved in one run, against a real `mlflow server`.

    python -m benchmarks.mlflow_overhead [--rounds=3] [--steps=2000] [--config=configs/mlp.py]

Each round runs `mwloop.main` twice on the same config, in turn (the order alternates by round): writers
("tensorboard",) and ("tensorboard", "mlflow") with MLFLOW_TRACKING_URI pointing at an `mlflow server`
(SQLite store, 127.0.0.1) this script starts. Per run: the end-of-run examples/s "with eval and saves" (all of train():
the MLflow run's creation and params, every checkpoint's send, the export's upload included) and the median
of the train log windows (metrics.jsonl `examples_per_sec`, the steps alone). Ratios on/off are taken within
a round, then the median over rounds is printed. The MLP is the worst case: its steps are so short that
per-checkpoint work weighs most.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from tests.test_mlflow import MlflowServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args: argparse.Namespace, workdir: str, mlflow_uri: str | None) -> tuple[float, float]:
    """(examples/s with eval and saves, median train-window examples/s) of one run."""
    writers = "('tensorboard', 'mlflow')" if mlflow_uri else "('tensorboard',)"
    command = [sys.executable, "-m", "mwloop.main", f"--config={args.config}", f"--workdir={workdir}",
               f"--config.train.steps={args.steps}", "--config.train.log_every_steps=50",
               "--config.train.eval_every_steps=200", "--config.train.checkpoint_every_steps=100",
               "--config.distribution.strategy=default", f"--config.writers={writers}"]
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3", MLFLOW_EXPERIMENT_NAME="overhead")
    if mlflow_uri:
        env["MLFLOW_TRACKING_URI"] = mlflow_uri
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    overall = float(re.search(r"\(([\d,]+) examples/s with eval and saves\)", proc.stderr)[1].replace(",", ""))
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        windows = [e["examples_per_sec"] for e in map(json.loads, f) if e["split"] == "train"][1:]
    return overall, statistics.median(windows)


def sink_cost(uri: str, workdir: str, steps: int) -> str:
    """Seconds spent inside the MLflow sink for the events of one run (a log every 50 steps, an eval every 200,
    a checkpoint every 100), timed in this process: the cost that does not depend on the machine's load."""
    import time

    from mwloop.artifacts import mlflow_sink, writers
    from mwloop.config import base as config_base
    config = config_base.load(os.path.join(ROOT, "configs", "mlp.py"))
    os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME="sink-cost")
    writer = writers.MetricWriter(workdir, enabled=True, sinks=[mlflow_sink.MlflowSink(config, workdir)])
    train = {"loss": 0.1, "accuracy": 0.9, "examples": 3200.0, "examples_per_sec": 1e5, "learning_rate": 0.1}
    started = time.perf_counter()
    writer.write_config(config)  # the run's creation and its params
    start_s, sends = time.perf_counter() - started, []
    for step in range(50, steps + 1, 50):
        writer.write(step, "train", train)
        if step % 200 == 0:
            writer.write(step, "eval", {"loss": 0.1, "accuracy": 0.9, "examples": 359.0})
        if step % 100 == 0:
            began = time.perf_counter()
            writer.checkpointed(step)
            sends.append(time.perf_counter() - began)
    began = time.perf_counter()
    writer.close("FINISHED", checkpointed_step=steps)
    close_s = time.perf_counter() - began
    return (f"inside the sink: start {start_s:.2f} s, {len(sends)} checkpoint sends {sum(sends):.2f} s "
            f"(median {statistics.median(sends) * 1000:.0f} ms), close {close_s:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "mlp.py"))
    parser.add_argument("--sink_only", action="store_true", help="only time the sink's own calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = MlflowServer(os.path.join(tmp, "mlflow"))
        try:
            print(sink_cost(server.uri, os.path.join(tmp, "sink"), args.steps), flush=True)
            if args.sink_only:
                return
            ratios_overall, ratios_window = [], []
            for i in range(args.rounds):
                if i % 2:  # alternate the order, so a trend in the machine's load favours neither
                    on = run(args, os.path.join(tmp, f"on{i}"), server.uri)
                    off = run(args, os.path.join(tmp, f"off{i}"), None)
                else:
                    off = run(args, os.path.join(tmp, f"off{i}"), None)
                    on = run(args, os.path.join(tmp, f"on{i}"), server.uri)
                ratios_overall.append(on[0] / off[0])
                ratios_window.append(on[1] / off[1])
                print(f"round {i}: off {off[0]:,.0f} examples/s overall, {off[1]:,.0f} in train windows; "
                      f"on {on[0]:,.0f} / {on[1]:,.0f}", flush=True)
        finally:
            server.stop()
    print(f"MLflow on/off, median of {args.rounds} rounds: overall {statistics.median(ratios_overall):.3f}, "
          f"train windows {statistics.median(ratios_window):.3f}")


if __name__ == "__main__":
    main()
