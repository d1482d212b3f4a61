"""Throughput of mwloop against its peers, side by side in one run.

    python -m benchmarks.throughput [--cases=mlp,resnet_digits,resnet50]
        [--strategies=default,mirrored] [--repeats=5]
        [--peers=raw,"raw (with metrics)",mwloop,"mwloop (tf.data iterator)",fit,tutorial]

Per (case, strategy), every peer runs in its own process (benchmarks/peers.py),
started one at a time. Then the parent runs `repeats` rounds; in each round
every peer runs one window of the same number of steps, one peer at a time,
in a rotated order. Throughput is the median over rounds; a ratio is the
median over rounds of the two peers' per-round ratio (robust to load drift:
this machine has 2 cores shared with other users).

Time to first step: from building the model, data and function to the first
call's result, minus (steps in that call - 1) x the peer's median step time,
so a K-step call and a 1-step call compare as "first step".
Peak memory: the peer process's ru_maxrss (whole process, TF runtime included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from benchmarks.peers import CASES, PEERS

WINDOW_STEPS = {"mlp": 2000, "resnet_digits": 50, "resnet50": 4}  # a window is ~0.1-3 s per peer here


class Peer:
    """A peer process: start, run windows, quit."""

    def __init__(self, case: str, strategy: str, name: str, window_steps: int):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.peers", f"--case={case}", f"--strategy={strategy}",
             f"--peer={name}", f"--window_steps={window_steps}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.info = self._read()
        self.elapsed: list[float] = []

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"error": f"exited with code {self.proc.wait()}"}

    @property
    def ok(self) -> bool:
        return "error" not in self.info

    def run_window(self) -> None:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        self.elapsed.append(self._read()["elapsed_s"])

    def quit(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.info.update(self._read())
            self.proc.wait()


def measure(case: str, strategy: str, peer_names: list[str], repeats: int) -> list[dict]:
    """Start the peers, run interleaved rounds, return one result row per peer."""
    window_steps = WINDOW_STEPS[case]
    peers = []
    for name in peer_names:
        print(f"  starting {case}/{strategy}/{name}", file=sys.stderr, flush=True)
        peers.append(Peer(case, strategy, name, window_steps))
    live = [p for p in peers if p.ok]
    for r in range(repeats):
        for p in live[r % len(live):] + live[:r % len(live)]:  # rotate: no peer always runs first
            p.run_window()
    for p in peers:
        p.quit()
    return [row(p, peers, window_steps) for p in peers]


def _ratio(a: "Peer", b: "Peer | None") -> float | None:
    """Median over rounds of throughput(a) / throughput(b) (= b's time / a's time)."""
    if b is None or not b.ok or not a.ok:
        return None
    return statistics.median(tb / ta for ta, tb in zip(a.elapsed, b.elapsed))


def row(p: Peer, peers: list[Peer], window_steps: int) -> dict:
    by_name = {q.name: q for q in peers}
    if not p.ok:
        return {"peer": p.name, "error": p.info["error"]}
    gbs = p.info["global_batch_size"]
    step_s = statistics.median(p.elapsed) / window_steps
    first_step_s = p.info["first_call_s"] - (p.info["steps_in_first_call"] - 1) * step_s
    return {"peer": p.name, "examples_per_sec": gbs / step_s, "vs_mwloop": _ratio(p, by_name.get("mwloop")),
            "vs_raw": _ratio(p, by_name.get("raw")), "first_step_s": first_step_s,
            "peak_rss_mb": p.info["peak_rss_mb"], "windows": len(p.elapsed)}


def table(rows_by_run: dict[tuple[str, str], list[dict]]) -> str:
    """The markdown table of all runs."""
    lines = ["| case | strategy | peer | examples/s | vs mwloop | vs raw | first step (s) | peak RSS (MB) |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for (case, strategy), rows in rows_by_run.items():
        raw_rss = next((r["peak_rss_mb"] for r in rows if r["peer"] == "raw" and "error" not in r), None)
        for r in rows:
            if "error" in r:
                lines.append(f"| {case} | {strategy} | {r['peer']} | fails: {r['error']} | | | | |")
                continue
            rss = fmt(r["peak_rss_mb"], ".0f") + (f" ({r['peak_rss_mb'] / raw_rss:.2f}x raw)" if raw_rss else "")
            lines.append(f"| {case} | {strategy} | {r['peer']} | {r['examples_per_sec']:,.0f} | "
                         f"{fmt(r['vs_mwloop'], '.2f')} | {fmt(r['vs_raw'], '.2f')} | "
                         f"{r['first_step_s']:.2f} | {rss} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="mlp,resnet_digits,resnet50")
    parser.add_argument("--strategies", default="default,mirrored")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    results: dict[tuple[str, str], list[dict]] = {}
    t0 = time.perf_counter()
    for case in args.cases.split(","):
        if case not in CASES:
            parser.error(f"--cases: unknown case {case!r}; use some of {', '.join(CASES)}")
        for strategy in args.strategies.split(","):
            results[(case, strategy)] = measure(case, strategy, args.peers.split(","), args.repeats)
            print(table({(case, strategy): results[(case, strategy)]}), file=sys.stderr, flush=True)
    print(table(results))
    print(f"\n({time.perf_counter() - t0:.0f} s; `python -m benchmarks.throughput {' '.join(sys.argv[1:])}`)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{c}/{s}": rows for (c, s), rows in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
