"""Entry point: python -m mwloop.main --config=configs/resnet.py[:arg] --workdir=DIR [--config.KEY=VALUE]."""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from mwloop import train

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/resnet.py:digits.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics (default: runs/<config name>).")
flags.DEFINE_enum("mode", "train_and_eval", train.MODES, "What to run.")
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    workdir = FLAGS.workdir or train.default_workdir(FLAGS["config"].config_filename, FLAGS.config)
    if not FLAGS.workdir:
        print(f"workdir: {workdir}", flush=True)
    try:
        train.train_and_evaluate(FLAGS.config, workdir, FLAGS.mode)
    except (ValueError, FileNotFoundError, RuntimeError, FloatingPointError) as e:
        logging.error("%s: %s", type(e).__name__, e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
