"""`mwloop.main` for multi-worker tests, printing a digest of the state each worker restored.

    TF_CONFIG=... python -m tests.digest_worker --config=configs/mlp.py --workdir=DIR

Runs the real `train_and_evaluate`; only `Checkpointer.restore` is wrapped, so
the printed digest is of exactly what this worker holds after its restore.
"""

import hashlib

import numpy as np
import tensorflow as tf

from mwloop import main
from mwloop.artifacts import checkpoint


def state_digest(ckpt: tf.train.Checkpoint) -> str:
    """sha256 of the model's and optimizer's variables and the step, in their fixed order."""
    digest = hashlib.sha256()
    for variable in [*ckpt.model.weights, *ckpt.optimizer.variables, ckpt.step]:
        digest.update(np.asarray(variable.numpy()).tobytes())  # this worker's own copy
    return digest.hexdigest()[:16]


def _report_restore(restore):
    def wrapped(self: checkpoint.Checkpointer):
        path = restore(self)
        print(f"restored {path} digest {state_digest(self.checkpoint)}", flush=True)
        return path
    return wrapped


if __name__ == "__main__":
    checkpoint.Checkpointer.restore = _report_restore(checkpoint.Checkpointer.restore)
    main.run()
