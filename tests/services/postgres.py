"""A throwaway PostgreSQL server: Debian's `postgresql` binaries, `initdb` in a temp dir, `postgres` on
127.0.0.1 at a free port, trust authentication, one database. As root it runs as the `postgres` system
user the package creates (the server refuses to run as root)."""

from __future__ import annotations

import dataclasses
import getpass
import glob
import os
import shutil
import signal
import subprocess

import portpicker

from tests.services import Daemon, ServiceError, as_user, find_program, private_dir, wait_until

USER = "mwloop"  # the database's superuser (any name: trust authentication on 127.0.0.1 only)
DATABASE = "mwloop"


@dataclasses.dataclass
class Postgres:
    """A running server. `url` is what SQLAlchemy (and Optuna's --storage) take; it names the psycopg2 driver
    because SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3."""
    url: str
    port: int
    directory: str
    daemon: Daemon
    argv: list[str] = dataclasses.field(default_factory=list)  # the server's command, to start it again
    user: str | None = None

    def halt(self) -> None:
        """Stops the server (fast shutdown: clients lose their connections), keeping its data: an outage."""
        self.daemon.stop()

    def resume(self, timeout_s: float = 30.0) -> None:
        """Starts the halted server again on its port and data; returns once it accepts connections."""
        self.daemon = Daemon("postgres", self.argv, log=self.daemon.log, user=self.user, stop_signal=signal.SIGINT)
        wait_until(lambda: _accepts(self.port), f"postgres on 127.0.0.1:{self.port}", [self.daemon], timeout_s)

    def stop(self) -> None:
        """Stops the server by PID and removes its files."""
        self.daemon.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def _bin_dirs() -> list[str]:
    return sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)  # Debian's versioned dirs, newest first


def _listening(directory: str, port: int) -> bool:
    """Whether the server listens: it makes its Unix socket after binding 127.0.0.1:port (a bare TCP connect
    could reach another program that holds the port)."""
    return os.path.exists(os.path.join(directory, f".s.PGSQL.{port}"))


def _accepts(port: int) -> bool:
    """Whether the server answers a query (its socket exists before it has finished recovery)."""
    import psycopg2

    try:
        psycopg2.connect(host="127.0.0.1", port=port, user=USER, dbname=DATABASE, connect_timeout=2).close()
        return True
    except psycopg2.OperationalError:
        return False


def start(timeout_s: float = 30.0) -> Postgres:
    """Initialises a cluster and starts its server; ServiceError (one line) if it cannot."""
    initdb = find_program("initdb", _bin_dirs())
    postgres = find_program("postgres", [os.path.dirname(initdb)])
    createdb = find_program("createdb", [os.path.dirname(initdb)])
    run_as = "postgres" if os.geteuid() == 0 else getpass.getuser()
    directory = private_dir("mwloop-postgres-", owner=run_as if os.geteuid() == 0 else None)
    data = os.path.join(directory, "data")
    log = os.path.join(directory, "postgres.log")
    try:
        _init(initdb, data, directory, run_as)
        port = portpicker.pick_unused_port()
        argv = [postgres, "-D", data, "-h", "127.0.0.1", "-p", str(port), "-k", directory]
        daemon = Daemon("postgres", argv, log=log, user=run_as, stop_signal=signal.SIGINT)  # SIGINT: fast shutdown
        server = Postgres(url=f"postgresql+psycopg2://{USER}@127.0.0.1:{port}/{DATABASE}", port=port,
                          directory=directory, daemon=daemon, argv=argv, user=run_as)
        try:
            wait_until(lambda: _listening(directory, port), f"postgres on 127.0.0.1:{port}", [daemon], timeout_s)
            done = subprocess.run([createdb, "-h", "127.0.0.1", "-p", str(port), "-U", USER, DATABASE],
                                  capture_output=True, text=True, timeout=timeout_s)
            if done.returncode:
                raise ServiceError(f"postgres: createdb failed: {done.stderr.strip().splitlines()[-1:]}")
        except BaseException:
            daemon.stop()  # its directory stays, with the log the error names
            raise
    except ServiceError:
        raise
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return server


def _init(initdb: str, data: str, directory: str, run_as: str) -> None:
    argv = [initdb, "-D", data, "-U", USER, "--auth=trust", "--no-sync", "-E", "UTF8", "--locale=C"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=directory, timeout=120, **as_user(run_as))
    if done.returncode:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise ServiceError(f"postgres: initdb failed: {lines[-1] if lines else done.returncode}")
