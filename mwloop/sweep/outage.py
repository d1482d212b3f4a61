"""Riding out an outage of the study's database: every storage call of an agent retried with backoff.

A PostgreSQL server restarted, failed over or briefly unreachable made `study.ask`, `tell`, `report` and the
heartbeat raise (sqlalchemy's OperationalError inside optuna's StorageInternalError); the agent died and took
its trial's training with it, leaving the trial RUNNING. Here the agent's storage is wrapped: a call that
fails for want of a connection is retried (0.5 s doubling to 10 s), the agent says once what it waits for
(the storage without its password, since when, until when), and says when it is back. Past the deadline
(`--storage_outage_s`) the call raises StorageOutageError: the agent stops its trial with a save and exits
EXIT_OUTAGE with one line. The trial's own process never talks to the storage, so it trains on meanwhile.

Only connection errors are retried: a statement optuna got wrong would fail the same way every time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import optuna
from absl import logging
from optuna.storages._heartbeat import BaseHeartbeat

from mwloop.sweep.values import SweepError, redact

# The default --storage_outage_s: how long an agent waits for its storage before it gives up.
OUTAGE_S = 300.0
# EX_TEMPFAIL: the agent gave up on its storage; run it again once the storage is back.
EXIT_OUTAGE = 75
FIRST_WAIT_S, MAX_WAIT_S = 0.5, 10.0


class StorageOutageError(SweepError):
    """The study's storage did not answer for longer than the agent waits (one line, the storage named)."""


def transient(error: BaseException) -> bool:
    """Whether `error` says the storage could not be reached (connection refused or lost, server shutting
    down), rather than that a statement was wrong: such a call succeeds once the server is back."""
    import sqlalchemy.exc as sa

    seen = 0
    # optuna's StorageInternalError wraps sqlalchemy's error (__cause__).
    while error is not None and seen < 5:
        if isinstance(error, (sa.OperationalError, sa.InterfaceError, sa.DisconnectionError)):
            return True
        if isinstance(error, sa.DBAPIError) and error.connection_invalidated:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


class Outage:
    """The state of one storage's outage, shared by every agent thread of the process: when it began, and
    when the last one ended (a trial's heartbeat is judged only after a grace past it: `recovered_within`).

    Attributes:
      since: time.time() of the first failed call of the current outage (None while the storage answers).
      ended: time.monotonic() when the last outage ended.
    """

    def __init__(self, url: str, deadline_s: float = OUTAGE_S, sleep: Callable[[float], None] = time.sleep):
        self.url, self.deadline_s, self.sleep = url, deadline_s, sleep
        self.since: float | None = None
        self.ended: float | None = None
        self._lock = threading.Lock()

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), retried while the storage is unreachable; StorageOutageError past the deadline.
        `what` names the call in the message (e.g. "tell")."""
        wait, attempts = FIRST_WAIT_S, 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except optuna.exceptions.UpdateFinishedTrialError:
                if attempts and what == "set_trial_state_values":
                    # The lost answer's commit went through: the trial is already told.
                    return True
                raise
            except Exception as e:
                if not transient(e):
                    raise
                attempts += 1
                self._failed(what, e)
                self.sleep(wait)
                wait = min(2 * wait, MAX_WAIT_S)
                continue
            if attempts:
                self._back()
            return result

    def _failed(self, what: str, error: BaseException) -> None:
        with self._lock:
            now = time.time()
            if self.since is None:
                self.since = now
                reason = str(getattr(error.__cause__, "orig", None) or error.__cause__ or error).strip()
                reason = (reason.splitlines() or ["?"])[0][:200]
                logging.warning("storage %s does not answer (%s: %s); waiting for it since %s, until %s "
                                "(--storage_outage_s=%g); running trials go on", redact(self.url), what, reason,
                                time.strftime("%H:%M:%S", time.localtime(now)),
                                time.strftime("%H:%M:%S", time.localtime(now + self.deadline_s)), self.deadline_s)
            if now - self.since > self.deadline_s:
                raise StorageOutageError(
                    f"storage {redact(self.url)} did not answer for {now - self.since:.0f}s "
                    f"(--storage_outage_s={self.deadline_s:g}); the running trial saved and stops: run the "
                    f"agent again once the storage is back") from None

    def _back(self) -> None:
        with self._lock:
            if self.since is not None:
                logging.warning("storage %s is back after %.0fs", redact(self.url), time.time() - self.since)
                self.since, self.ended = None, time.monotonic()

    def recovered_within(self, seconds: float) -> bool:
        """Whether the storage was down within the last `seconds` (or is down): heartbeats others could not
        record then say nothing about their agents."""
        return self.since is not None or (self.ended is not None and time.monotonic() - self.ended < seconds)


class RidingStorage(optuna.storages.BaseStorage, BaseHeartbeat):
    """An optuna storage whose every call goes through `outage.call`; the rest is the wrapped storage's."""

    def __init__(self, inner: optuna.storages.BaseStorage, outage: Outage):
        self._inner, self.outage = inner, outage

    def __getattr__(self, name: str) -> Any:
        """engine, url, ...: what the wrapped storage has."""
        return getattr(self._inner, name)


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: RidingStorage, *args: Any, **kwargs: Any) -> Any:
        return self.outage.call(name, getattr(self._inner, name), *args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"The wrapped storage's {name}, retried while the storage is unreachable."
    return method


for _name in (sorted(optuna.storages.BaseStorage.__abstractmethods__ | BaseHeartbeat.__abstractmethods__)
              + ["get_trial_params", "get_trial_user_attrs", "get_trial_system_attrs", "get_n_trials",
                 "get_best_trial", "get_trial_number_from_id", "get_trial_param", "check_trial_is_updatable"]):
    if hasattr(optuna.storages.RDBStorage, _name):
        setattr(RidingStorage, _name, _delegate(_name))
RidingStorage.__abstractmethods__ = frozenset()


def riding(storage: optuna.storages.BaseStorage, url: str, deadline_s: float = OUTAGE_S) -> RidingStorage:
    """`storage` wrapped to ride out outages of up to `deadline_s` seconds."""
    return RidingStorage(storage, Outage(url, deadline_s))
