"""`python -m tests.stress.nohup MODULE ARGS...`: runs `python -m MODULE ARGS...` with SIGHUP ignored, as `nohup`
starts a command (same process, so a fault sent to it reaches the module)."""

import runpy
import signal
import sys

if __name__ == "__main__":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
