"""Weak scaling: 2 local workers (one core each) against 1 worker on one core.

    python -m benchmarks.scaling [--cases=mlp,resnet_digits] [--k=1,4] [--rounds=2] [--windows=5] [--json=FILE]

For each case, `rounds` times and in turn: 1 worker (benchmarks/scaling_worker.py
alone: default strategy, pinned to core 0), then 2 workers started by
`mwloop.launch.launch(..., module="benchmarks.scaling_worker")` (TF_CONFIG per
worker, MultiWorkerMirroredStrategy, worker i pinned to core i). Every worker runs
1 intra-op and 1 inter-op thread, and trains on the case's batch B (global 2B
with 2 workers: weak scaling), so a load burst from other users hits both
configurations.

Per run: examples/s = global batch / median step time over `windows` timed windows
(after one warm-up window). Scaling efficiency = 2-worker examples/s / (2 x 1-worker
examples/s), per adjacent (1-worker, 2-worker) pair; the median over pairs is
reported. All-reduce share = the time of a standalone all-reduce of the model's
gradient shapes in the same 2-worker cluster (median window, same step count) /
the 2-worker step time (and, in brackets, an all-reduce of one float: the
collective's fixed latency). A third run per round starts 2 unconnected 1-worker
processes at once (cores 0 and 1, no collectives): their summed examples/s over
2 x 1-worker is the ceiling this machine's 2 cores allow without any communication.

--k=K1,K2,...: gradient accumulation (config.optimizer.gradient_accumulation_steps) for every run
of a row; the case's batch is then the per-worker micro-batch, a step is one update of K micro-steps
(one all-reduce), and examples/s count all K micro-batches. Both the 1-worker and the 2-worker runs
accumulate, so the efficiency is of the same training (same effective batch per worker).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from mwloop.launch import launch

WINDOW_STEPS = {"mlp": 1000, "resnet_digits": 100}  # multiples of the case's K=50


BATCH = 0  # --batch: per-worker batch override (0: the case's batch)
BYTES_PER_PACK = 0  # --bytes_per_pack: the workers' config.distribution.bytes_per_pack
ACCUMULATION = 1  # one of --k: micro-batches per update of the runs being made
ONE_WORKER_LAUNCHED = False  # --one_worker=launch: the 1-worker run through mwloop.launch (1-worker TF_CONFIG)


def run(case: str, workers: int, windows: int, out_dir: str, tag: str) -> dict:
    """One run of `workers` local workers; the chief's per-window times."""
    out = os.path.join(out_dir, f"{case}-k{ACCUMULATION}-{workers}w-{tag}.json")
    args = [f"--case={case}", f"--out={out}", f"--window_steps={WINDOW_STEPS[case]}", f"--windows={windows}",
            f"--batch={BATCH}", f"--bytes_per_pack={BYTES_PER_PACK}", f"--k={ACCUMULATION}"]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    log = out + ".log"
    t = time.perf_counter()
    with open(log, "wb") as log_file:
        if workers == 1 and not ONE_WORKER_LAUNCHED:  # no TF_CONFIG: the default strategy, as a lone user runs
            code = subprocess.run([sys.executable, "-m", "benchmarks.scaling_worker", *args], env=env,
                                  stdout=log_file, stderr=subprocess.STDOUT).returncode
        else:  # launch pumps the workers' output to this process's stdout/stderr: into the log meanwhile
            sys.stdout.flush()
            sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(log_file.fileno(), 1)
            os.dup2(log_file.fileno(), 2)
            try:
                code = launch(args, workers, env=env, grace_s=5.0, module="benchmarks.scaling_worker")
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])
    if code:
        with open(log, errors="replace") as f:
            print("".join(f.readlines()[-30:]), file=sys.stderr)
        raise SystemExit(f"{case}, {workers} worker(s): exit code {code} (the log's last lines above)")
    with open(out) as f:
        result = json.load(f)
    steps = result["window_steps"]
    result["step_s"] = statistics.median(result["train_s"]) / steps
    result["allreduce_step_s"] = statistics.median(result["allreduce_s"]) / steps
    result["scalar_allreduce_step_s"] = statistics.median(result["scalar_allreduce_s"]) / steps
    result["examples_per_sec"] = result["global_batch"] / result["step_s"]
    result["wall_s"] = time.perf_counter() - t
    print(f"  {case} k={ACCUMULATION} {workers}w: {result['examples_per_sec']:,.0f} examples/s, "
          f"step {result['step_s'] * 1e6:,.0f} us, "
          f"all-reduce {result['allreduce_step_s'] * 1e6:,.0f} us ({result['wall_s']:.0f} s)", file=sys.stderr,
          flush=True)
    return result


def run_independent(case: str, windows: int, out_dir: str, tag: str) -> dict:
    """The hardware ceiling: 2 unconnected 1-worker processes at once (cores 0 and 1, default strategy,
    no collectives); examples/s is the sum of the two."""
    outs = [os.path.join(out_dir, f"{case}-k{ACCUMULATION}-indep{i}-{tag}.json") for i in range(2)]
    t = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.scaling_worker", f"--case={case}", f"--out={out}",
                               f"--window_steps={WINDOW_STEPS[case]}", f"--windows={windows}",
                               f"--batch={BATCH}", f"--k={ACCUMULATION}"],
                              env=dict({k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
                                       SCALING_CORE=str(i), TF_CPP_MIN_LOG_LEVEL="3"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i, out in enumerate(outs)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"{case}, 2 independent workers: exit codes {[p.returncode for p in procs]}")
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    step_s = [statistics.median(r["train_s"]) / r["window_steps"] for r in results]
    result = {"examples_per_sec": sum(r["global_batch"] / s for r, s in zip(results, step_s)),
              "step_s": statistics.median(step_s), "wall_s": time.perf_counter() - t}
    print(f"  {case} k={ACCUMULATION} 2 independent: {result['examples_per_sec']:,.0f} examples/s, step "
          f"{result['step_s'] * 1e6:,.0f} us ({result['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    return result


def summarize(case: str, triples: list[tuple[dict, dict, dict]]) -> dict:
    one = [a for a, _, _ in triples]
    two = [b for _, b, _ in triples]
    indep = [c for _, _, c in triples]
    pairs = [(a, b) for a, b, _ in triples]
    med = lambda rs, key: statistics.median(r[key] for r in rs)  # noqa: E731
    return {"case": case, "params": one[0]["params"], "batch_per_worker": one[0]["per_worker_batch"],
            "k": one[0].get("accumulation_steps", 1),
            "one_worker_eps": med(one, "examples_per_sec"), "two_worker_eps": med(two, "examples_per_sec"),
            "one_step_us": med(one, "step_s") * 1e6, "two_step_us": med(two, "step_s") * 1e6,
            "efficiency": statistics.median(b["examples_per_sec"] / (2 * a["examples_per_sec"]) for a, b in pairs),
            "efficiencies": [b["examples_per_sec"] / (2 * a["examples_per_sec"]) for a, b in pairs],
            "allreduce_us": med(two, "allreduce_step_s") * 1e6,
            "scalar_allreduce_us": med(two, "scalar_allreduce_step_s") * 1e6,
            "allreduce_share": statistics.median(b["allreduce_step_s"] / b["step_s"] for b in two),
            "extra_step_us": (med(two, "step_s") - med(one, "step_s")) * 1e6,
            "indep_eps": med(indep, "examples_per_sec"), "indep_step_us": med(indep, "step_s") * 1e6,
            "indep_efficiency": statistics.median(c["examples_per_sec"] / (2 * a["examples_per_sec"])
                                                  for a, _, c in triples)}


def table(rows: list[dict]) -> str:
    lines = ["| case | params | k | batch/worker (micro x k) | 1 worker (ex/s) | 2 workers (ex/s) | "
             "step 1w / 2w (us) | "
             "efficiency (per pair) | all-reduce/step (us; 1 float) | all-reduce share of 2w step | "
             "2 independent 1-worker processes (ex/s, efficiency) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        per_pair = ", ".join(f"{e:.2f}" for e in r["efficiencies"])
        batch = f"{r['batch_per_worker']} x {r['k']}" if r["k"] > 1 else str(r["batch_per_worker"])
        lines.append(f"| {r['case']} | {r['params']:,} | {r['k']} | {batch} | {r['one_worker_eps']:,.0f} | "
                     f"{r['two_worker_eps']:,.0f} | {r['one_step_us']:,.0f} / {r['two_step_us']:,.0f} | "
                     f"**{r['efficiency']:.2f}** ({per_pair}) | "
                     f"{r['allreduce_us']:,.0f} ({r['scalar_allreduce_us']:,.0f}) | "
                     f"{r['allreduce_share']:.0%} | {r['indep_eps']:,.0f} ({r['indep_efficiency']:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mlp,resnet_digits")
    parser.add_argument("--rounds", type=int, default=2, help="(1-worker, 2-worker) pairs per case")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per run")
    parser.add_argument("--batch", type=int, default=0, help="per-worker batch (0: the case's: MLP 64, ResNet 128)")
    parser.add_argument("--bytes_per_pack", type=int, default=0,
                        help="the workers' config.distribution.bytes_per_pack (0: all gradients in one all-reduce)")
    parser.add_argument("--one_worker", choices=("default", "launch"), default="default",
                        help="the 1-worker baseline: run alone (no TF_CONFIG), or through mwloop.launch (a "
                             "1-worker TF_CONFIG; mwloop's create_strategy picks the default strategy for it too)")
    parser.add_argument("--k", default="1", help="comma-separated gradient_accumulation_steps values: one row each")
    parser.add_argument("--json", default="", help="also write the runs and rows to this file")
    args = parser.parse_args(argv)
    global BATCH, BYTES_PER_PACK, ONE_WORKER_LAUNCHED, ACCUMULATION
    BATCH, BYTES_PER_PACK = args.batch, args.bytes_per_pack
    ONE_WORKER_LAUNCHED = args.one_worker == "launch"
    if (os.cpu_count() or 1) < 2:
        print("note: fewer than 2 cores; both workers share core 0", file=sys.stderr)
    t0 = time.perf_counter()
    rows, runs = [], {}
    with tempfile.TemporaryDirectory() as out_dir:
        for case in args.cases.split(","):
            if case not in WINDOW_STEPS:
                parser.error(f"--cases: unknown case {case!r}; use some of {', '.join(WINDOW_STEPS)}")
            for k in (int(x) for x in args.k.split(",")):
                ACCUMULATION = k
                triples = [(run(case, 1, args.windows, out_dir, str(r)), run(case, 2, args.windows, out_dir, str(r)),
                            run_independent(case, args.windows, out_dir, str(r))) for r in range(args.rounds)]
                runs[f"{case} k={k}"] = triples
                rows.append(summarize(case, triples))
    print(table(rows))
    print(f"\n({time.perf_counter() - t0:.0f} s; `python -m benchmarks.scaling {' '.join(sys.argv[1:])}`)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
