"""Hyperparameter sweeps: each point of `experiments/<name>.py` as its own training process.

  python -m mwloop.sweep --sweep=experiments/resnet_lr.py [--config=configs/resnet.py:digits] \
      --workdir=DIR [--parallel=P] [--num_workers=W]

A sweep file defines `get_sweep(arg=None)`, a list of override dicts keyed by
config path, and may set `CONFIG`, `METRIC` and `MODE` as defaults. Every
point is checked against the config before anything runs; each runs in
`DIR/<name from its overrides>/`, a finished point is skipped on rerun, a
failed one is recorded and retried on rerun. See docs/sweeps.md.
"""

from __future__ import annotations

import signal
import sys

from absl import app, flags

from mwloop.sweep import SweepError, run_sweep


def _define_flags() -> None:
    # Only when run as a program: importing this module (a test, a tool) must not define global flags.
    flags.DEFINE_string("sweep", None, "Sweep file experiments/<name>.py[:arg] defining get_sweep().")
    flags.DEFINE_string("config", None, "Base config FILE[:ARG] (default: the sweep file's CONFIG).")
    flags.DEFINE_string("workdir", None, "Sweep directory: one subdirectory per point, results.* at the top.")
    flags.DEFINE_integer("parallel", 1, "Points run at the same time.", lower_bound=1)
    flags.DEFINE_integer("num_workers", 1, "Worker processes per point (> 1: through mwloop.launch).", lower_bound=1)
    flags.DEFINE_string("metric", None, "Rank by <split>/<metric> (default: the sweep's METRIC or eval/accuracy).")
    flags.DEFINE_enum("mode", None, ["max", "min"], "Whether a higher or lower metric is better.")
    flags.mark_flags_as_required(["sweep", "workdir"])


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: stop the children rather than orphan them


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    signal.signal(signal.SIGTERM, _interrupt)
    FLAGS = flags.FLAGS
    try:
        failed = run_sweep(sweep_spec=FLAGS.sweep, sweep_dir=FLAGS.workdir, config_spec=FLAGS.config,
                           parallel=FLAGS.parallel, num_workers=FLAGS.num_workers, metric=FLAGS.metric,
                           mode=FLAGS.mode)
    except SweepError as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:
        sys.exit("interrupted: run the same command again to resume the sweep")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
