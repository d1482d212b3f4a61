"""Test setup: two logical CPUs, so MirroredStrategy has two replicas without a GPU.

Logical devices can only be configured before TensorFlow starts, so this runs
at import, before any test touches TensorFlow.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# PreemptionCheckpointHandler probes for GCE with an HTTP request to the metadata
# host; point it (here and in every worker the tests start) at a closed local port.
os.environ["GCE_METADATA_IP"] = "127.0.0.1:9"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # configs/ and experiments/ are loaded by path from the repo root

from mwloop import testing  # noqa: E402

testing.split_cpu(2)


import pytest  # noqa: E402

# Real services (PostgreSQL, a one-node Slurm, etcd) as session fixtures: postgres_url, slurm_cluster, etcd_server.
pytest_plugins = ["tests.services.fixtures"]


@pytest.fixture(scope="session")
def mirrored_strategy():
    """The process's one two-replica MirroredStrategy (mwloop.testing's, which its checks use too):
    several in one process share collective instance keys and can abort each other's all-reduces."""
    return testing.replica_strategy(2)


@pytest.fixture(autouse=True)
def float32_policy():
    """Runs set Keras' process-global precision policy; each test starts from float32."""
    import keras
    keras.mixed_precision.set_global_policy("float32")
    yield


def pytest_collection_modifyitems(config, items):
    """Slow tests first (a stable sort: each file's order stays): with `-n 2` the last minutes then hold only
    short tests to share between the two workers, instead of one worker finishing a minute-long story alone.
    README's command adds `--dist worksteal`: xdist's default hands out tests in chunks ahead of time, and at
    the end one worker could still hold queued stories while the other idled."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
