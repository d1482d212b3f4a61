"""This checkout against another (e.g. the landed main), side by side: the mwloop peer of each, interleaved.

    git worktree add /tmp/landed <commit>
    python -m benchmarks.checkouts --other=/tmp/landed [--repeats=9] [--cases=mlp,resnet_digits]

Each checkout's own `benchmarks.peers` runs in its own process with its own `mwloop` (PYTHONPATH), so a
change to the loop is measured against the code before it in one run, on the same load; the order of the
two alternates by round, and the two halves of the rounds start the two processes in either order. The
ratio is the median over rounds of this/other throughput.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from benchmarks import throughput

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CheckoutPeer(throughput.Peer):
    """The mwloop peer of the checkout at `root`."""

    def __init__(self, case: str, strategy: str, root: str, window_steps: int):
        self.name = root
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.peers", f"--case={case}", f"--strategy={strategy}", "--peer=mwloop",
             f"--window_steps={window_steps}"], cwd=root, env=dict(os.environ, PYTHONPATH=root),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.info = self._read()
        self.elapsed: list[float] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--other", required=True, help="the other checkout's root (a git worktree)")
    parser.add_argument("--cases", default="mlp,resnet_digits")
    parser.add_argument("--strategies", default="default,mirrored")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    print("| case | strategy | this (ex/s) | other (ex/s) | this/other | per-round range |")
    print("|---|---|---:|---:|---:|---|")
    for case in args.cases.split(","):
        for strategy in args.strategies.split(","):
            window = throughput.WINDOW_STEPS[case]
            elapsed: dict[str, list[float]] = {HERE: [], args.other: []}
            for half in range(2):
                # The process started first ran 2-7 % slower in an A/A run (the same code on both sides): each
                # half starts the two in the other order.
                roots = (HERE, args.other) if half == 0 else (args.other, HERE)
                started = {root: CheckoutPeer(case, strategy, root, window) for root in roots}
                this, other = started[HERE], started[args.other]
                if not (this.ok and other.ok):
                    sys.exit(f"a peer did not start: {this.info} {other.info}")
                for r in range(len(range(half, args.repeats, 2))):  # this half's rounds
                    for peer in (this, other) if r % 2 == 0 else (other, this):
                        peer.run_window()
                for peer in (this, other):
                    peer.quit()
                    elapsed[peer.name] += peer.elapsed
            ratios = [o / t for t, o in zip(elapsed[HERE], elapsed[args.other])]  # other/this: this's speed-up
            examples = this.info["global_batch_size"] * window
            print(f"| {case} | {strategy} | {examples / statistics.median(elapsed[HERE]):,.0f} | "
                  f"{examples / statistics.median(elapsed[args.other]):,.0f} | {statistics.median(ratios):.3f} | "
                  f"{min(ratios):.2f}-{max(ratios):.2f} ({args.repeats} rounds) |", flush=True)


if __name__ == "__main__":
    main()
