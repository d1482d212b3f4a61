"""`python -m tests.stress.with_fsize BYTES MODULE ARGS...`: runs `python -m MODULE ARGS...` under a file-size
limit (RLIMIT_FSIZE, what a shell's `ulimit -f` or a batch system's file-size limit sets)."""

import resource
import runpy
import sys

if __name__ == "__main__":
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
