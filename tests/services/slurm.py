"""A one-node Slurm cluster on this machine: Debian's `slurm-wlm` and `munge`, everything in a temp dir.

munged runs with its own key and socket; slurm.conf describes this machine as the one node (its values
from `slurmd -C`), with the controller and the node on 127.0.0.1 at free ports, `proctrack/linuxproc` and
`task/none` (no cgroups), no accounting database. slurmctld and slurmd run in the foreground as children of
the test process, so they are stopped by PID. Clients (sbatch, srun, sinfo, squeue) find the cluster
through `SLURM_CONF` in the environment the fixture yields.
"""

from __future__ import annotations

import dataclasses
import getpass
import os
import re
import shutil
import socket
import subprocess
import time

import portpicker

from tests.services import Daemon, ServiceError, find_program, private_dir, wait_until

PARTITION = "debug"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}


@dataclasses.dataclass
class Slurm:
    """A running cluster. `env` is os.environ plus SLURM_CONF: run the clients with it."""
    env: dict[str, str]
    conf: str
    node: str
    directory: str
    daemons: list[Daemon]

    def run(self, *argv: str, env: dict[str, str] | None = None, timeout_s: float = 60.0,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (output captured as text); `env` defaults to `self.env`
        and must hold SLURM_CONF when given (sbatch exports it to the job)."""
        return subprocess.run(list(argv), env=env or self.env, capture_output=True, text=True, timeout=timeout_s,
                              cwd=cwd)

    def wait(self, job_id: str, timeout_s: float = 600.0) -> list[dict[str, str]]:
        """Waits until the job (every task of an array job) has ended; returns `scontrol show job`'s fields of
        each (JobState, ExitCode "code:signal", ArrayTaskId, ...). Polls every 0.2 s: `sbatch --wait` polls
        every few seconds, and the tests would wait for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            done = self.run("scontrol", "--oneliner", "show", "job", job_id, timeout_s=30)
            if done.returncode:
                raise ServiceError(f"scontrol show job {job_id}: {done.stderr.strip()}")
            jobs = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in done.stdout.splitlines() if line.strip()]
            if jobs and all(job.get("JobState") in FINISHED for job in jobs):
                return jobs
            if time.monotonic() > deadline:
                states = ", ".join(f"{j.get('JobId')}: {j.get('JobState')}" for j in jobs)
                raise TimeoutError(f"Slurm job {job_id} still not finished after {timeout_s:.0f} s ({states})")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancels what still runs, stops the daemons by PID (slurmd, slurmctld, munged) and removes the files."""
        if all(d.process.poll() is None for d in self.daemons):
            try:
                self.run("scancel", f"--user={getpass.getuser()}", timeout_s=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for daemon in reversed(self.daemons):
            daemon.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def node_line(hardware: str | None = None) -> str:
    """This machine's node definition from `slurmd -C` (its CPUs, sockets, cores, threads, memory)."""
    if hardware is None:
        done = subprocess.run([find_program("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
        hardware = done.stdout
    line = next((line for line in hardware.splitlines() if line.startswith("NodeName=")), None)
    if line is None:
        raise ServiceError(f"slurmd -C printed no NodeName line: {hardware.strip()[:200]!r}")
    return line


def write_conf(directory: str, node: str, hardware: str, munge_socket: str, user: str) -> str:
    """slurm.conf for a one-node cluster on 127.0.0.1, everything it writes under `directory`."""
    fields = dict(re.findall(r"(\w+)=(\S+)", hardware))
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    node_values = " ".join(f"{key}={fields[key]}" for key in keep if key in fields)
    ctld_port, slurmd_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    conf = f"""\
# A one-node test cluster written by tests/services/slurm.py
ClusterName=mwloop-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={directory}/state
SlurmdSpoolDir={directory}/spool/%n
SlurmctldPidFile={directory}/slurmctld.pid
SlurmdPidFile={directory}/slurmd.pid
SlurmctldLogFile={directory}/slurmctld.log
SlurmdLogFile={directory}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
KillWait=10
MinJobAge=3600  # finished jobs stay visible to `scontrol show job` (Slurm.wait) for an hour
NodeName={node} NodeAddr=127.0.0.1 {node_values} State=UNKNOWN
PartitionName={PARTITION} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""
    path = os.path.join(directory, "slurm.conf")
    with open(path, "w") as f:
        f.write(conf)
    return path


def start(timeout_s: float = 30.0) -> Slurm:
    """Brings up munged, slurmctld and slurmd and waits for the node to be idle; ServiceError (one line)
    naming the daemon that could not start and why."""
    munged, slurmctld, slurmd = (find_program(name) for name in ("munged", "slurmctld", "slurmd"))
    find_program("sinfo")
    node = socket.gethostname().split(".")[0]
    hardware = node_line()
    directory = private_dir("mwloop-slurm-")
    daemons: list[Daemon] = []
    try:
        munge_socket = _start_munge(munged, directory, daemons)
        for sub in ("state", f"spool/{node}"):
            os.makedirs(os.path.join(directory, sub))
        conf = write_conf(directory, node, hardware, munge_socket, getpass.getuser())
        env = dict(os.environ, SLURM_CONF=conf)
        cluster = Slurm(env=env, conf=conf, node=node, directory=directory, daemons=daemons)
        daemons.append(Daemon("slurmctld", [slurmctld, "-D", "-f", conf], os.path.join(directory, "slurmctld.out"),
                              env=env, cwd=directory))
        daemons.append(Daemon("slurmd", [slurmd, "-D", "-f", conf, "-N", node], os.path.join(directory, "slurmd.out"),
                              env=env, cwd=directory))
        wait_until(lambda: _node_state(cluster) == "idle", f"slurm node {node} (sinfo idle)", daemons, timeout_s)
    except BaseException as e:
        for daemon in reversed(daemons):
            daemon.stop()
        if not isinstance(e, ServiceError):  # else its directory stays, with the logs the error names
            shutil.rmtree(directory, ignore_errors=True)
        raise
    return cluster


def _start_munge(munged: str, directory: str, daemons: list[Daemon]) -> str:
    """munged with a fresh key (in a directory only we read) and a socket in a directory all may enter."""
    key_dir, socket_dir = os.path.join(directory, "munge-key"), os.path.join(directory, "munge")
    os.makedirs(key_dir, mode=0o700)
    os.makedirs(socket_dir, mode=0o755)
    key = os.path.join(key_dir, "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(os.urandom(1024))
    munge_socket = os.path.join(socket_dir, "munge.socket")
    daemon = Daemon("munged", [munged, "--foreground", f"--key-file={key}", f"--socket={munge_socket}",
                               f"--pid-file={socket_dir}/munged.pid", f"--seed-file={key_dir}/munged.seed",
                               f"--log-file={key_dir}/munged.log"],
                    os.path.join(directory, "munged.out"))
    daemons.append(daemon)
    wait_until(lambda: os.path.exists(munge_socket), "munged socket", [daemon], 10.0)
    return munge_socket


def _node_state(cluster: Slurm) -> str:
    try:
        done = cluster.run("sinfo", "--noheader", "--nodes", cluster.node, "--format=%T", timeout_s=10)
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout.strip()
