"""The suite's own services (tests/services/): they answer, and a daemon that cannot start says which and why.

The Slurm cluster's happy path is exercised by tests/test_slurm.py and tests/test_backends.py, etcd's by
tests/test_rendezvous.py.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess

import pytest

from tests.services import ServiceError, etcd, find_program, postgres, slurm


def kept_directory(message: str) -> str:
    """The service's directory a start-up error names (kept for its logs); the log must exist."""
    log = re.search(r"\(log: (\S+)\)$", message)
    assert log and os.path.exists(log[1]), message
    return os.path.dirname(log[1])


def psql(url: str, sql: str) -> subprocess.CompletedProcess:
    psql_bin = find_program("psql", [os.path.dirname(find_program("initdb", postgres._bin_dirs()))])
    libpq_url = url.replace("+psycopg2", "")  # libpq takes postgresql://, SQLAlchemy the driver-qualified URL
    return subprocess.run([psql_bin, libpq_url, "-tAc", sql], capture_output=True, text=True, timeout=30)


@pytest.mark.slow
def test_postgres_answers_at_its_url_and_the_database_is_writable(postgres_url):
    assert postgres_url.startswith("postgresql+psycopg2://mwloop@127.0.0.1:")
    done = psql(postgres_url, "CREATE TABLE t (x int); INSERT INTO t VALUES (41), (1); SELECT sum(x) FROM t; "
                              "DROP TABLE t;")
    assert done.returncode == 0, done.stderr
    assert "\n42\n" in done.stdout


@pytest.mark.slow
def test_postgres_that_cannot_bind_its_port_is_one_line_naming_it(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(postgres.portpicker, "pick_unused_port", lambda: port)
        with pytest.raises(ServiceError) as error:
            postgres.start(timeout_s=20)
    message = str(error.value)
    shutil.rmtree(kept_directory(message))
    assert message.startswith("postgres ") and "\n" not in message
    assert "could not" in message.lower() or "in use" in message.lower() or "not ready" in message, message


@pytest.mark.slow
def test_slurm_daemon_that_cannot_start_is_one_line_naming_it(monkeypatch):
    write_conf = slurm.write_conf

    def broken_conf(*args, **kwargs):
        path = write_conf(*args, **kwargs)
        with open(path) as f:
            text = f.read()
        with open(path, "w") as f:
            f.write(text.replace("proctrack/linuxproc", "proctrack/nosuchplugin"))
        return path

    monkeypatch.setattr(slurm, "write_conf", broken_conf)
    with pytest.raises(ServiceError) as error:
        slurm.start(timeout_s=20)
    message = str(error.value)
    shutil.rmtree(kept_directory(message))
    assert message.startswith("slurm") and "\n" not in message, message
    assert message.startswith("slurmd exited with code 1 at start-up: ") and "nosuchplugin" in message, message


@pytest.mark.slow
def test_etcd_answers_and_pauses(etcd_server):
    assert etcd_server.url == f"http://127.0.0.1:{etcd_server.port}" and etcd.healthy(etcd_server.url)
    etcd_server.pause()
    try:
        assert not etcd.healthy(etcd_server.url)
    finally:
        etcd_server.resume()
    assert etcd.healthy(etcd_server.url)


@pytest.mark.slow
def test_etcd_that_cannot_bind_its_port_is_one_line_naming_it(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(etcd.portpicker, "pick_unused_port", lambda: port)
        with pytest.raises(ServiceError) as error:
            etcd.start(timeout_s=20)
    message = str(error.value)
    shutil.rmtree(kept_directory(message))
    assert message.startswith("etcd exited with code 1 at start-up: ") and "\n" not in message, message
    assert "address already in use" in message, message


def test_node_line_keeps_the_hardware_values():
    line = slurm.node_line("junk\nNodeName=n1 CPUs=8 Boards=1 SocketsPerBoard=2 CoresPerSocket=4 ThreadsPerCore=1 "
                           "RealMemory=64000\nUpTime=1-00:00:00\n")
    assert line.startswith("NodeName=n1 CPUs=8")
    with pytest.raises(ServiceError, match="no NodeName line"):
        slurm.node_line("slurmd: error: something")
