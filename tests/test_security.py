"""The local launcher keeps its workers' unauthenticated TensorFlow ports off the network; files in a workdir
are not trusted (no writing through planted links, no workdir of another user, config.name stays in runs/)."""

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


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_workers_share_a_network_namespace_of_their_own():
    proc = launch_probe()
    assert proc.returncode == 0, proc.stderr
    namespaces = worker_namespaces(proc)
    assert len(namespaces) == 1, "both workers must see each other's loopback"
    assert namespaces != {os.readlink("/proc/self/ns/net")}, "the workers' ports must not be on this network"
    assert "reachable only from each other" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux-only")
def test_network_host_shares_the_machines_network_and_says_so():
    proc = launch_probe("--network=host")
    assert proc.returncode == 0, proc.stderr
    assert worker_namespaces(proc) == {os.readlink("/proc/self/ns/net")}
    assert "listen on every interface, unauthenticated (--network=host)" in proc.stderr


# ---------------------------------------------------------------------------- files in the workdir are not trusted

def _victim(tmp_path) -> str:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return str(victim)


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "config.json", "config.json.tmp", "checkpoints"])
def test_a_planted_symlink_is_refused_in_one_line_and_never_written_through(tmp_path, name):
    from mwloop.artifacts import workdir_lock
    victim = _victim(tmp_path)
    workdir = tmp_path / "run"
    workdir.mkdir()
    os.symlink(victim, workdir / name)
    with pytest.raises(workdir_lock.UntrustedWorkdirError, match=rf"{re.escape(name)} is a symlink"):
        workdir_lock.acquire(str(workdir))
    assert open(victim).read() == "precious\n"


def test_a_hard_linked_metrics_file_and_a_world_writable_workdir_are_refused(tmp_path):
    from mwloop.artifacts import workdir_lock
    workdir = tmp_path / "run"
    workdir.mkdir()
    os.link(_victim(tmp_path), workdir / "metrics.jsonl")
    with pytest.raises(workdir_lock.UntrustedWorkdirError, match="has 2 hard links"):
        workdir_lock.check_trusted(str(workdir))
    os.remove(workdir / "metrics.jsonl")
    os.chmod(workdir, 0o777)
    with pytest.raises(workdir_lock.UntrustedWorkdirError, match="writable by every user"):
        workdir_lock.check_trusted(str(workdir))
    os.chmod(workdir, 0o755)
    workdir_lock.acquire(str(workdir)).close()  # a workdir of our own is fine


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_workdir_of_another_user_is_refused(tmp_path):
    from mwloop.artifacts import workdir_lock
    workdir = tmp_path / "run"
    workdir.mkdir()
    os.chown(workdir, 65534, 65534)
    with pytest.raises(workdir_lock.UntrustedWorkdirError, match="belongs to uid 65534"):
        workdir_lock.acquire(str(workdir))
    assert not os.path.exists(workdir / ".lock")


def test_rewrites_never_follow_a_planted_temporary_file(tmp_path):
    from mwloop.artifacts import jsonl
    victim = _victim(tmp_path)
    os.symlink(victim, tmp_path / "config.json.tmp")
    with jsonl.atomic_open(str(tmp_path / "config.json")) as f:
        f.write("{}\n")
    assert open(victim).read() == "precious\n" and (tmp_path / "config.json").read_text() == "{}\n"
    os.symlink(victim, tmp_path / "linked.json")
    with pytest.raises(OSError):
        jsonl.read_json(str(tmp_path / "linked.json"), nofollow=True)


@pytest.mark.parametrize("name, escapes", [("../../x", True), ("/tmp/x", True), ("a/../../x", True), ("", True),
                                           ("mlp", False), ("sweeps/mlp-1", False)])
def test_config_name_cannot_take_the_default_workdir_out_of_runs(name, escapes):
    from mwloop.errors import UserError
    from mwloop.run import train
    from tests.helpers import load_config
    config = load_config("mlp")
    config.name = name
    if escapes:
        with pytest.raises(UserError, match="outside runs/"):
            train.default_workdir(config)
    else:
        assert train.default_workdir(config) == os.path.join("runs", name)


def test_nonfinite_metrics_are_strict_json_null_with_a_flag():
    import json
    import math

    from mwloop.artifacts import jsonl
    line = jsonl.dumps({"step": 3, "split": "eval", "loss": math.nan, "accuracy": 0.5, "top": -math.inf})
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}")) == {
        "step": 3, "split": "eval", "loss": None, "accuracy": 0.5, "top": None, "nonfinite": ["loss", "top"]}
