"""`python -m tests.stress.head_one MODULE ARGS...`: `python -m MODULE ARGS 2>&1 | head -1`, for the fault case
of a reader that goes away (tests/stress/fault_cases_usercode.py).

Reads one line of the command's output (stdout and stderr together, as `2>&1 | head -1`), closes the pipe,
and waits for the command, which must end by itself; prints the line read and the command's exit, and exits
with its code.
"""

from __future__ import annotations

import subprocess
import sys

from tests.stress.fault_harness import ROOT


def main(argv: list[str]) -> int:
    """Runs argv as `python -m`, reads its first line, closes the reader, returns the command's exit code."""
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    first = proc.stdout.readline()
    proc.stdout.close()  # `head` exits: every later write of the command meets a closed pipe
    print(f"head read: {first.decode(errors='replace').rstrip()}", flush=True)
    code = proc.wait()
    print(f"the command exited {code} after its reader went away", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
