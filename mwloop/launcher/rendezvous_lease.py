"""The lease an elastic job's agent is a member on (mwloop.launcher.rendezvous): renewed every ttl/3 from a
daemon thread, lost when etcd expires it or no renewal gets through for ttl_s, revoked on leave. When it is
lost, the agent's `on_lost(reason)` is called once, and every call that needs it raises LeaseLost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import etcd3gw
from absl import logging

from mwloop.launcher.etcd_client import CALL_ERRORS, LeaseLost, RendezvousError, reason
from mwloop.launcher.etcd_client import client as _client


class LeaseKeeper:
    """The lease part of an `EtcdRendezvous`, its base class: the lease, its keep-alive thread and whether it
    was lost. The rendezvous sets the attributes below and makes every request (`_call`)."""

    url: str
    host: str
    port: int
    job: str
    ttl_s: int
    host_id: str | None
    on_lost: Callable[[str], None] | None

    def __init__(self):
        # Guards the lease and its keep-alive, shared with the keep-alive thread.
        self._lock = threading.Lock()
        self._lease: etcd3gw.Lease | None = None
        self._stop_keep_alive = threading.Event()
        self._lost: str | None = None
        # When the newest renewal that etcd answered was sent (time.monotonic()).
        self._renewed_at = 0.0

    def confirm_lease(self) -> str | None:
        """`lost_lease`, made sure of before this agent acts as a member: after a freeze (SIGSTOP, a stalled VM)
        the keep-alive thread and the agent's wake together, and the agent must not act on a round it was dropped
        from before that thread finds out. One renewal from this thread, only when the newest is older than the
        keep-alive makes them (every ttl/3)."""
        with self._lock:
            lease, age = self._lease, time.monotonic() - self._renewed_at
        if lease is None or self._lost or age < self.ttl_s * 2 / 3:
            return self._lost
        self._renew(lease, time.monotonic())
        return self._lost

    @property
    def lost_lease(self) -> str | None:
        """Why this agent's lease was lost (it has left the job), or None while it is a member."""
        return self._lost

    def _keep_alive(self, lease_id: int, stop: threading.Event) -> None:
        """Renews the lease every ttl/3 until stopped or lost (`_renew`)."""
        period = self.ttl_s / 3
        # Its own session, timing out after `period`: a hung request must not outlast the lease.
        lease = etcd3gw.Lease(lease_id, _client(self.host, self.port, period))
        while not stop.wait(period) and not self._renew(lease, time.monotonic()):
            pass

    def _renew(self, lease: etcd3gw.Lease, sent: float) -> bool:
        """One renewal sent at `sent`; whether the lease is lost: etcd says it expired, or no renewal got through
        for ttl_s (measured from when the newest good one was sent, so etcd's expiry is no earlier): then etcd may
        have dropped us, and an agent that cannot tell must act as dropped."""
        try:
            ttl = lease.refresh()
        except CALL_ERRORS as e:
            with self._lock:
                age = time.monotonic() - self._renewed_at
            if age >= self.ttl_s:
                self._set_lost(lease.id, f"no lease renewal reached etcd at {self.url} for {self.ttl_s} s "
                                         f"({reason(e)})", revoke=lease)
            return age >= self.ttl_s
        if ttl <= 0:
            self._set_lost(lease.id, f"etcd at {self.url} expired this agent's lease (no renewal reached it "
                                     f"for {self.ttl_s} s)")
            return True
        with self._lock:
            self._renewed_at = max(self._renewed_at, sent)
        return False

    def _set_lost(self, lease_id: int, reason: str, revoke: etcd3gw.Lease | None = None) -> None:
        with self._lock:
            if self._lease is None or self._lease.id != lease_id or self._lost:
                return
            self._lost = reason
            self._stop_keep_alive.set()
        logging.warning("%s left job %s: %s", self.host_id, self.job, reason)
        # First: the agent must stop its workers now, not after a revoke's timeout.
        if self.on_lost is not None:
            try:
                self.on_lost(reason)
            # The callback's bug must not go unseen, nor kill the thread's caller.
            except Exception:
                logging.exception("on_lost callback of %s failed", self.host_id)
        # etcd may still hold it: let the membership match what we now believe.
        if revoke is not None:
            self._revoke(revoke, quietly=True)

    def _live_lease(self) -> etcd3gw.Lease:
        with self._lock:
            lease, lost = self._lease, self._lost
        if lease is None or lost:
            raise LeaseLost(f"{self.host_id or 'this agent'} is not in job {self.job!r}: "
                            f"{lost or 'it has not joined'}")
        return lease

    def _drop_lease(self, revoke: bool = True) -> etcd3gw.Lease | None:
        with self._lock:
            lease, self._lease = self._lease, None
            self._stop_keep_alive.set()
        if lease is not None and revoke:
            self._revoke(lease, quietly=True)
        return lease

    def _revoke(self, lease: etcd3gw.Lease, quietly: bool = False) -> None:
        try:
            self._call("revoke the lease", lease.revoke)
        except LeaseLost:
            pass  # already expired: its keys are gone
        except RendezvousError:
            if not quietly:
                raise

    def _call(self, what: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """function(*args, **kwargs), its failures as one-line RendezvousErrors: the rendezvous' requests."""
        raise NotImplementedError
