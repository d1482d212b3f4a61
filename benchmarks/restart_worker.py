"""`python -m restart_worker ARGS`: `python -m mwloop.main ARGS` that prints when its imports were done.

benchmarks/restart.py runs its workers through this (the launcher's `--module`), so that a restart's start-up
splits into the interpreter's start, the imports (TensorFlow, Keras, mwloop) and what comes after, whichever
checkout of mwloop is on PYTHONPATH (it only calls `mwloop.main.run`, which every checkout has). It is put on
PYTHONPATH as a top-level module, so another checkout's `benchmarks` package does not hide it.
"""

import time

_PYTHON_UP = time.time()  # the interpreter and site are up; nothing of ours is imported yet

from mwloop import main  # noqa: E402 - the imports being timed: TensorFlow, Keras and mwloop's modules
from mwloop.launcher import console  # noqa: E402 - mwloop.main imports TensorFlow only after the config check

console.import_tensorflow_quietly()
from mwloop.run import train  # noqa: E402, F401

print(f"restart-probe: python {_PYTHON_UP:.6f} imported {time.time():.6f}", flush=True)

if __name__ == "__main__":
    main.run()
