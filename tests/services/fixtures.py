"""pytest fixtures for the real services (registered for the whole suite by tests/conftest.py).

Session-scoped: a test session (each xdist worker) that asks for one brings it up once, in a few seconds,
and stops it by PID at the end. A service that cannot start fails the test with one line naming the daemon
and why; it never skips (CI installs the packages: `bash tests/services/install.sh`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.services import ServiceError, etcd, postgres, slurm


def _running(start, what: str) -> Iterator:
    """The service `start()` brings up, stopped by PID afterwards; one failing line if it cannot start."""
    try:
        service = start()
    except ServiceError as e:
        pytest.fail(f"{what}: {e}", pytrace=False)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[postgres.Postgres]:
    """A running PostgreSQL server (its `url`, `port`, `directory`)."""
    yield from _running(postgres.start, "PostgreSQL test server")


@pytest.fixture(scope="session")
def postgres_url(postgres_server: postgres.Postgres) -> str:
    """A SQLAlchemy URL of an empty database on the test server: postgresql+psycopg2://mwloop@127.0.0.1:PORT/mwloop
    (the driver named: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which is not installed)."""
    return postgres_server.url


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[slurm.Slurm]:
    """A one-node Slurm cluster with an idle node; run sbatch/srun/squeue with its `env` (SLURM_CONF set)."""
    yield from _running(slurm.start, "Slurm test cluster")


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[etcd.Etcd]:
    """A running one-member etcd (its client `url`, `rendezvous_url(job)`); tests share it, so each uses its own
    job name (its keys live under /mwloop/<job>/). A test that pauses etcd starts its own with etcd.start()."""
    yield from _running(etcd.start, "etcd test server")
