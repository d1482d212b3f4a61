"""Prints the goodput report of a workdir: python -m mwloop.goodput DIR [--json].

Reads only DIR/metrics.jsonl (no TensorFlow): the run may be finished, running, or SIGKILLed (its last
attempt has no end record; the report is rebuilt from its start record and its clock after each checkpoint).
The records and how they add up: mwloop.artifacts.goodput.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mwloop import errors
from mwloop.artifacts import files, goodput, jsonl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mwloop.goodput", description=__doc__.split("\n")[0])
    parser.add_argument("workdir", help="a run's workdir (the one given to --workdir)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.workdir, files.METRICS)):
        print(f"error: no {files.METRICS} in {args.workdir}; give a run's --workdir", file=sys.stderr)
        return errors.USER_ERROR
    try:
        result = goodput.report(files.read_metrics(args.workdir))
    except jsonl.CorruptFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return errors.USER_ERROR
    print(json.dumps(result.figures()) if args.json else goodput.format_report(result, args.workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
