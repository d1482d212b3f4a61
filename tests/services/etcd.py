"""A throwaway one-member etcd: Debian's `etcd-server` (3.4), on 127.0.0.1 at free ports, data in a temp dir.

Clients talk to it through its v3 HTTP gateway (`url` + /v3/...: what etcd3gw and mwloop.launcher.rendezvous
use). `pause()` / `resume()` SIGSTOP and SIGCONT the daemon: to the clients that is a partition (requests hang,
leases run out), and unlike killing it the data survives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import time
import urllib.error
import urllib.request

import portpicker

from tests.services import Daemon, ServiceError, find_program, private_dir, wait_until

NAME = "mwloop-test"


@dataclasses.dataclass
class Etcd:
    """A running member. `url` is its client URL (http://127.0.0.1:PORT); `rendezvous_url(job)` the
    etcd://HOST:PORT/JOB form mwloop's launcher takes."""
    url: str
    host: str
    port: int
    directory: str
    daemon: Daemon
    argv: list[str] = dataclasses.field(default_factory=list)

    def rendezvous_url(self, job: str) -> str:
        return f"etcd://{self.host}:{self.port}/{job}"

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP: the member stops answering (and stops expiring leases) until `resume()`. Returns once the
        kernel shows it stopped: the signal is delivered asynchronously, and a request sent just after kill()
        could still be answered."""
        os.kill(self.daemon.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while _state(self.daemon.pid) != "T":
            if time.monotonic() > deadline:
                raise ServiceError(f"etcd (pid {self.daemon.pid}) not stopped {timeout_s:.0f} s after SIGSTOP")
            time.sleep(0.01)

    def resume(self) -> None:
        os.kill(self.daemon.pid, signal.SIGCONT)

    def wipe(self, timeout_s: float = 30.0) -> None:
        """Kills the member, deletes its data and starts it again, empty, on the same ports: to its clients, etcd
        lost every key, lease and revision (a disk lost, a data dir wiped)."""
        self.daemon.process.kill()
        self.daemon.process.wait()
        shutil.rmtree(os.path.join(self.directory, "data"))
        self.daemon = Daemon("etcd", self.argv, log=os.path.join(self.directory, "etcd.log"), cwd=self.directory)
        wait_until(lambda: healthy(self.url), f"etcd on {self.url} after a wipe", [self.daemon], timeout_s)

    def stop(self) -> None:
        """Stops the member by PID (resumed first: a stopped process would not see SIGTERM) and removes its files."""
        if self.daemon.process.poll() is None:
            self.resume()
        self.daemon.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _reasons(log: str) -> str:
    """What etcd's log (zap's JSON lines) says went wrong: "msg: error" of its warn-or-worse entries, the
    last three (the generic last_line would quote whole JSON objects, stack traces and all)."""
    reasons = []
    try:
        with open(log, errors="replace") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and entry.get("level") in ("warn", "error", "fatal", "panic"):
                    reasons.append(f"{entry.get('msg')}: {entry.get('error')}" if "error" in entry
                                   else str(entry.get("msg")))
    except OSError:
        return ""
    return " | ".join(dict.fromkeys(reasons[-3:]))


def _state(pid: int) -> str:
    """The process state letter from /proc/PID/stat (R, S, T for stopped, ...): the field after "(comm)"."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def healthy(url: str) -> bool:
    """Whether the member answers /health with {"health": "true"}: it has a leader and serves requests (a
    bare TCP connect could reach another program holding the port, or an etcd not yet elected)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return json.load(response).get("health") == "true"
    except (OSError, ValueError, urllib.error.URLError):
        return False


def start(timeout_s: float = 30.0, host: str = "127.0.0.1") -> Etcd:
    """Starts one etcd member and waits until it is healthy; ServiceError (one line, naming the log) if not.
    `host`: the address its client port listens on (a test bridge's, for agents in network namespaces)."""
    etcd = find_program("etcd")
    directory = private_dir("mwloop-etcd-")
    client_port, peer_port = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    client_url, peer_url = f"http://{host}:{client_port}", f"http://127.0.0.1:{peer_port}"
    argv = [etcd, "--name", NAME, "--data-dir", os.path.join(directory, "data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{NAME}={peer_url}", "--initial-cluster-state", "new",
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"]  # zap: 3.4's capnslog is deprecated
    log = os.path.join(directory, "etcd.log")
    try:
        daemon = Daemon("etcd", argv, log=log, cwd=directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    try:
        wait_until(lambda: healthy(client_url), f"etcd on {client_url} (log: {log})", [daemon], timeout_s)
    except BaseException as e:
        daemon.stop()
        if not isinstance(e, ServiceError):  # else its directory stays, with the log the error names
            shutil.rmtree(directory, ignore_errors=True)
            raise
        code = daemon.process.returncode
        reasons = _reasons(log)
        if code is None or not reasons:
            raise
        raise ServiceError(f"etcd exited with code {code} at start-up: {reasons} (log: {log})") from None
    return Etcd(url=client_url, host=host, port=client_port, directory=directory, daemon=daemon, argv=argv)
