"""Prints the goodput report of a workdir: python -m mwloop.goodput DIR [--json].

Reads only DIR/metrics.jsonl (no TensorFlow): the run may be finished, running, or SIGKILLed (its last
attempt has no end record; the report is rebuilt from its start record and its clock after each checkpoint).
The records and how they add up: mwloop.artifacts.goodput. A reader that goes away (`| head`) ends the command
quietly with its usual exit code: it read what it wanted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from mwloop import errors
from mwloop.artifacts import files, goodput, jsonl


def _say(text: str, stream: TextIO) -> None:
    """Prints `text`; a reader that went away (`| head`) read what it wanted: the rest goes nowhere, quietly."""
    try:
        print(text, file=stream, flush=True)
    except BrokenPipeError:
        # Python's own flush at exit would fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    """The command (see the module docstring); its exit code."""
    parser = argparse.ArgumentParser(prog="python -m mwloop.goodput", description=__doc__.split("\n")[0])
    parser.add_argument("workdir", help="a run's workdir (the one given to --workdir)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.workdir, files.METRICS)):
        _say(f"error: no {files.METRICS} in {args.workdir}; give a run's --workdir", sys.stderr)
        return errors.USER_ERROR
    try:
        result = goodput.report(files.read_metrics(args.workdir))
    except jsonl.CorruptFileError as e:
        _say(f"error: {e}", sys.stderr)
        return errors.USER_ERROR
    _say(json.dumps(result.figures()) if args.json else goodput.format_report(result, args.workdir), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
