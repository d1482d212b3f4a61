"""Entry point: python -m mwloop.main --config=configs/resnet.py[:arg] --workdir=DIR [--config.KEY=VALUE]."""

import os
import signal
import sys
from typing import NoReturn


def _interrupted_while_importing(signum, frame) -> NoReturn:
    print("interrupted: exiting with code 130", file=sys.stderr, flush=True)
    sys.exit(130)


# A Ctrl-C while Python imports this command's modules (before run() can catch it; on a loaded machine that
# takes seconds) is the same one line and exit 130, not an import's KeyboardInterrupt traceback.
if __name__ == "__main__":
    signal.signal(signal.SIGINT, _interrupted_while_importing)

from absl import app, flags  # noqa: E402 - after the import-time Ctrl-C handler
from ml_collections import config_flags  # noqa: E402 - after the import-time Ctrl-C handler

from mwloop import errors  # noqa: E402 - after the import-time Ctrl-C handler
from mwloop.config import check as config_check  # noqa: E402 - after the import-time Ctrl-C handler
from mwloop.launcher import closed_output, console  # noqa: E402 - after the import-time Ctrl-C handler

# TensorFlow is imported only once the flags and the config are checked (main): a typo in a flag or an override
# is one line in a fraction of a second, not after the seconds TensorFlow takes to load.

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/resnet.py:digits.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints and metrics (default: runs/<config name>).")
flags.DEFINE_enum("mode", "train_and_eval", config_check.MODES, "What to run.")
flags.mark_flags_as_required(["config"])


def user_error(message: str) -> NoReturn:
    """Exits with errors.USER_ERROR and `message` as one line on stderr: the launcher does not restart it."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(errors.USER_ERROR)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing, with a bad config path or override as one line, not a traceback."""
    try:
        argv = FLAGS(argv)
        # Config files load lazily: fail here, not mid-run.
        _ = FLAGS.config.name
        return argv
    # The config file's own sys.exit (absl's --help exits too: that one passes).
    except SystemExit as e:
        _user_exit(e)
        raise
    # config_flags raises KeyError, AttributeError, OSError, flags.Error...
    except Exception as e:
        # A get_config that returned None: config_flags only logs a warning.
        if FLAGS["config"].present and FLAGS["config"].value is None:
            user_error(f"--config={_config_arg(argv)}: get_config returned None (does it end with `return "
                       f"config`?)")
        user_error(f"{errors.one_line(e)} (check --config=FILE[:ARG] and the --config.KEY=VALUE overrides)")


def _config_arg(argv: list[str]) -> str:
    given = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return given[-1] if given else "?"


def _user_exit(exit: SystemExit) -> None:
    """A sys.exit in the user's code (config, task module, task method, dataset_fn) ends the run with exit 2 in
    one line: with exit 0 a run that trained nothing would look successful. mwloop's and absl's exits pass."""
    where = errors.exit_site(exit)
    if where:
        user_error(f"user code called sys.exit({exit.code!r}){where}; nothing after it ran (training did not "
                   f"finish): remove the exit, or raise an exception that says what is wrong")


def main(argv: list[str]) -> None:
    """Checks the flags and the config (before TensorFlow loads), then runs; how it ends is `_end`'s table."""
    console.use_console_format(progress_line=True)
    try:
        if len(argv) > 1:
            raise errors.UserError(f"unexpected arguments: {' '.join(argv[1:])}; give settings as "
                                   f"--config.KEY=VALUE")
        # The run's one check: a typo costs no TensorFlow import.
        config_check.check(FLAGS.config, FLAGS.mode)
        console.import_tensorflow_quietly()
        from mwloop.run import train
        console.quiet_tensorflow_logger()
        workdir = FLAGS.workdir or train.default_workdir(FLAGS.config)
        if not FLAGS.workdir:
            print(f"workdir: {workdir}", flush=True)
        train.run_checked(FLAGS.config, workdir, FLAGS.mode)
    except SystemExit as e:
        _user_exit(e)
        raise
    except Exception as e:
        _end(e)


def _end(error: Exception) -> NoReturn:
    """The one place a run's error becomes an exit: `errors.EXIT_CODES` gives the code and the message is one
    `error: ...` line (the launcher does not restart exit 2); any other error is internal and keeps its
    traceback."""
    code = errors.exit_code(error)
    if code is None:
        raise error
    print(f"error: {error}", file=sys.stderr, flush=True)
    if code == errors.USER_ERROR and _nothing_ran():
        # A refusal at the start (no TensorFlow op ran: nothing written, nothing to flush): the interpreter's
        # teardown after TensorFlow's import takes 3 s per process here, ~10 s for an elastic job's three workers
        # on a loaded machine, which its launcher would wait for.
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def _nothing_ran() -> bool:
    """Whether TensorFlow was imported but has run no op in this process (the eager runtime never started)."""
    if "tensorflow" not in sys.modules:
        return False
    from mwloop.cluster import distribute
    return not distribute.eager_context_started()


def run() -> None:
    """`app.run(main)`, where a Ctrl-C outside the training loop (which saves first) exits 130 in one line."""
    # The launcher forwards a Ctrl-C as INTERRUPT_SIGNAL; outside the training loop it is a plain Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(errors.INTERRUPT_SIGNAL, signal.default_int_handler)
    # `main | head`: training goes on, its output dropped.
    closed_output.survive_closed_output()
    try:
        app.run(main, flags_parser=parse_flags)
    except KeyboardInterrupt:
        print(f"interrupted: exiting with code {errors.INTERRUPTED}", file=sys.stderr, flush=True)
        sys.exit(errors.INTERRUPTED)


if __name__ == "__main__":
    run()
