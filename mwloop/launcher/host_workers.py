"""This machine's workers in an agent's round (mwloop.launcher.agent): started together, watched for the outcome
the agent posts in the round, stopped together (SIGTERM: a coordinated save when the round is whole; SIGKILL when
it is not, since every worker takes part in a save)."""

from __future__ import annotations

from mwloop import errors
from mwloop.launcher.attempt import Attempt, describe_exit, wait_for_exit
from mwloop.launcher.warm import WarmServer


class HostWorkers:
    """The workers this agent runs in its current round, if any.

    Attributes:
      attempt: the round's workers (None: none running).
      killed: pids of this agent's workers that a stop had to SIGKILL (they saved nothing on the way out).
    """

    def __init__(self, command: list[str], env: dict[str, str], grace_s: float, warm: WarmServer | None):
        """`warm`: the warm-start server the workers are forked from (mwloop.launcher.warm)."""
        self.command, self.env, self.grace_s, self.warm = command, env, grace_s, warm
        self.attempt: Attempt | None = None
        self.killed: list[int] = []

    @property
    def running(self) -> bool:
        return self.attempt is not None

    def start(self, cluster: list[str], first: int, count: int) -> None:
        """Starts workers first..first+count-1 of the worker-only `cluster` (index 0 the chief)."""
        self.attempt = Attempt(self.command, self.env, self.grace_s, warm=self.warm)
        for i in range(first, first + count):
            self.attempt.start(f"worker {i}", {"cluster": {"worker": cluster}, "task": {"type": "worker", "index": i}},
                               cluster[i])

    def kill_now(self) -> None:
        """SIGKILL to every worker, from any thread (a lost lease: the others go on without us)."""
        attempt = self.attempt
        for proc in list(attempt.procs.values()) if attempt else []:
            if proc.poll() is None:
                proc.kill()

    def outcome(self, host_id: str) -> dict | None:
        """The event this machine posts in the round once its workers are done or one failed, or None while
        they run: `done`, `user_error`, `saved` (a notice to a worker: all saved) or `failure`."""
        attempt = self.attempt
        failure = attempt.first_failure()
        if failure is None:
            return {"kind": "done"} if all(p.poll() == 0 for p in attempt.procs.values()) else None
        name, code = failure
        said = attempt.last_errors.get(name)
        if code == errors.USER_ERROR:
            said = said or "a user error (see its output above)"
            return {"kind": "user_error",
                    "line": f"{host_id} {name}: {said} (stopped all workers, no restart: it would repeat)"}
        # A notice to a worker alone: all saved; re-form.
        if code in (errors.PREEMPTED, errors.LEAVING):
            wait_for_exit(list(attempt.procs.values()), self.grace_s)
            return {"kind": "saved", "line": f"{host_id} {name} given notice: saved at the current step"}
        return {"kind": "failure", "code": code,
                "line": f"{host_id} {name} {describe_exit(code)}{' (' + said + ')' if said else ''}"}

    def stop(self, signum: int | None = None) -> None:
        """Stops the workers, if any: `signum` (default SIGTERM: they save), SIGKILL after grace_s. A signal to
        the agent meanwhile is raised once they stopped (mwloop.launcher.attempt.Attempt.stop)."""
        attempt, self.attempt = self.attempt, None
        if attempt is None:
            return
        if signum is not None:
            attempt.stop_signal = signum
        try:
            attempt.__exit__(None, None, None)
        finally:
            self.killed += attempt.killed
