"""The local launcher keeps its workers' unauthenticated TensorFlow ports off the network."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT


def launch_probe(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "mwloop.launch", "--num_workers=2", "--module=tests.netns_probe",
                           *flags, "--", "x"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def worker_namespaces(proc: subprocess.CompletedProcess) -> set[str]:
    return set(re.findall(r"\[worker \d\] netns (net:\[\d+\])", proc.stdout))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_workers_share_a_network_namespace_of_their_own():
    proc = launch_probe()
    assert proc.returncode == 0, proc.stderr
    namespaces = worker_namespaces(proc)
    assert len(namespaces) == 1, "both workers must see each other's loopback"
    assert namespaces != {os.readlink("/proc/self/ns/net")}, "the workers' ports must not be on this network"
    assert "reachable only from each other" in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_network_host_shares_the_machines_network_and_says_so():
    proc = launch_probe("--network=host")
    assert proc.returncode == 0, proc.stderr
    assert worker_namespaces(proc) == {os.readlink("/proc/self/ns/net")}
    assert "listen on every interface, unauthenticated (--network=host)" in proc.stderr
