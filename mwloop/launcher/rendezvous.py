"""An elastic job's membership in etcd: which agents are here, which rounds they agreed on, and what each
round's members published and reported. One `EtcdRendezvous` per agent (one agent per machine).

Keys, under /mwloop/<JOB>/: `generation`, the job's identity ({"id", "workdir"}: a fresh id whenever a job
starts under the name, see `join`), and under <generation id>/:

  ended                            the job's verdict once it ended ({"code", "line"}): a later job under the name
                                   starts a generation of its own and never reads it
  hosts/<host_id>                  the agent's info (JSON) on its lease: when the agent dies or is cut off,
                                   the lease runs out and etcd deletes the key, with nobody deleting it
  rounds/<number, 10 digits>       a round's members, created once: concurrent proposers race in one etcd
                                   transaction and exactly one wins (zero-padded: key order = round order)
  addresses/<number>/<host_id>     what a member published for a round (on its lease: a dead member's goes)
  events/<number>/<host_id>/<id>   what a member reported in a round (no lease: a leaving agent's last
                                   words outlive it)

A store that lost the job's state (etcd wiped, or restored from an older backup) is noticed at the next read
(`check`: the generation is gone or another): the agent re-forms the job in a new generation.

No consensus of our own: etcd's leases drop members and its transactions decide races. Every request has
a timeout, so an unreachable etcd is an `EtcdUnavailable` in bounded time, never a hang.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import etcd3gw
import requests
from absl import logging
from etcd3gw import exceptions as etcd_errors

from mwloop.errors import UserError
from mwloop.launcher import generation
from mwloop.launcher.etcd_client import (
    CALL_ERRORS,
    NAME,
    EtcdUnavailable,
    JobEnded,
    LeaseLost,
    RendezvousError,
    RoundIncomplete,
    StoreLost,
    dump,
    parse_url,
    reason,
)
from mwloop.launcher.etcd_client import client as _client
from mwloop.launcher.rendezvous_lease import LeaseKeeper

_ROUND_DIGITS = 10
# gather's polling: a few requests a second per agent, only while a round forms.
_POLL_S = 0.25
# How often a wait says what it waits for.
_REPORT_S = 5.0


class EtcdRendezvous(LeaseKeeper):
    """One agent's view of the job at `url` (etcd://HOST:PORT/JOB). Reads need no join; `join` registers this
    agent under a lease of `ttl_s` seconds, kept alive from a daemon thread. `request_timeout_s` bounds every
    request. Use it from one thread (the keep-alive has its own connection). `on_lost(reason)` is called once
    per lease lost, from the keep-alive thread (or the call that found out): stop this agent's workers there.
    The lease itself (`confirm_lease`, `lost_lease`, the keep-alive) is LeaseKeeper's (rendezvous_lease.py)."""

    def __init__(self, url: str, ttl_s: int = 10, request_timeout_s: float = 5.0,
                 on_lost: Callable[[str], None] | None = None):
        self.host, self.port, self.job = parse_url(url)
        # etcd grants whole seconds; 1 s leaves no time to renew.
        if ttl_s != int(ttl_s) or ttl_s < 2:
            raise ValueError(f"ttl_s must be a whole number of seconds >= 2, got {ttl_s}")
        self.url, self.ttl_s, self.request_timeout_s, self.on_lost = url, int(ttl_s), request_timeout_s, on_lost
        self.host_id: str | None = None
        # This agent's generation of the job (mwloop.launcher.generation), once it joined.
        self.generation: str | None = None
        self._workdir: str | None = None
        self._client = _client(self.host, self.port, request_timeout_s)
        self._info: dict = {}
        super().__init__()

    # Membership.

    def join(self, host_id: str, info: dict, workdir: str | None = None) -> str | None:
        """Registers this agent as `host_id` with `info` (JSON: its address, slots, ...) and keeps it there, in
        the job's live generation, or in a new one (mwloop.launcher.generation): then returns why. If the id is
        taken, waits up to ttl_s + 1 s (a crashed agent's key expires by then), then RendezvousError: another live
        agent holds that id. `workdir`: the workers' --workdir; UserError if a live job under the name has
        another."""
        if not NAME.fullmatch(host_id):
            raise UserError(f"bad host id {host_id!r}: letters, digits, '.', '_', '-' (it is an etcd key segment)")
        if self._lease is not None:
            raise RuntimeError(f"{host_id}: join() twice; rejoin() re-registers")
        self.host_id, self._info, self._workdir = host_id, dict(info), workdir
        return self._register(None, stale=False)

    def rejoin(self, stale: bool = False) -> str | None:
        """Registers again with a new lease (after `lost_lease`, or to start over): the agent joins at the end
        of the join order, in its generation if that is still there, else in a new one (returns why; `stale`:
        the caller found its generation went back in time). JobEnded if the job ended meanwhile. Never done
        behind the caller's back, so an agent dropped from a round knows it."""
        if self.host_id is None:
            raise RuntimeError("rejoin() before join()")
        self._drop_lease()
        return self._register(self.generation, stale)

    def check(self) -> None:
        """StoreLost unless etcd still holds this agent's generation of the job (one read)."""
        current = self._read_generation()
        if current is None:
            raise StoreLost(generation.lost(self.job, self.url, self.generation))
        if current[0]["id"] != self.generation:
            raise StoreLost(f"job {self.job!r} at {self.url} is in generation {current[0]['id']} now, not "
                            f"{self.generation} (a store restored or taken over)")

    def end(self, code: int, line: str | None) -> None:
        """Records the job's verdict: an agent that comes later under the name starts a new job."""
        if self.generation is not None:
            self._call("record the job's end", self._client.put, self._key("ended"),
                       dump({"code": code, "line": line}))

    def leave(self) -> None:
        """Revokes the lease: this agent's host and address keys go at once. EtcdUnavailable if etcd does not
        answer (they then go by themselves within ttl_s)."""
        lease = self._drop_lease(revoke=False)
        if lease is not None:
            self._revoke(lease)


    def hosts(self) -> dict[str, dict]:
        """The agents present now, in join order (etcd's create revision), each with its info."""
        return {key: json.loads(value) for key, value in self._range("hosts/", order="create")}

    def __enter__(self) -> EtcdRendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    # Rounds.

    def propose_round(self, number: int, members: Sequence[str]) -> bool:
        """Creates round `number` with `members` unless it exists: True for the one proposer that won."""
        if not members or len(set(members)) != len(members):
            raise ValueError(f"round {number}: members must be distinct and not empty, got {list(members)}")
        key = self._key("rounds", self._number(number))
        return self._call(f"propose round {number}", self._client.create, key, dump({"members": list(members)}))

    def round(self, number: int) -> list[str] | None:
        """Round `number`'s members, or None if nobody proposed it yet."""
        values = self._call(f"read round {number}", self._client.get, self._key("rounds", self._number(number)))
        return json.loads(values[0])["members"] if values else None

    def latest_round(self) -> tuple[int, list[str]] | None:
        """(number, members) of the highest round, or None before the first."""
        prefix = self._key("rounds", "")
        found = self._call("read the latest round", self._client.get, prefix, metadata=True, limit=1,
                           range_end=_prefix_end(prefix), sort_order="descend", sort_target="key")
        if not found:
            return None
        value, meta = found[0]
        return int(meta["key"].decode().rpartition("/")[2]), json.loads(value)["members"]

    def publish(self, number: int, value: dict) -> None:
        """Publishes this agent's `value` (its worker address, ...) for round `number`, on its lease; LeaseLost
        if the lease is gone."""
        lease = self._live_lease()
        key = self._key("addresses", self._number(number), self.host_id)
        self._call(f"publish for round {number}", self._client.put, key, dump(value), lease=lease)

    def gather(self, number: int, host_ids: Sequence[str], timeout_s: float) -> dict[str, dict]:
        """Every listed host's published value for round `number`, in the order given, once all have published.
        RoundIncomplete naming who is missing after `timeout_s`, or at once when one of them has left the job
        (its lease is gone: it will never publish)."""
        deadline = time.monotonic() + timeout_s
        next_report = time.monotonic() + _REPORT_S
        while True:
            published = {host: json.loads(value) for host, value in self._range(f"addresses/{self._number(number)}/")}
            missing = [host for host in host_ids if host not in published]
            if not missing:
                return {host: published[host] for host in host_ids}
            # Read after the addresses: absent now means gone for good.
            present = dict(self._range("hosts/"))
            left = [host for host in missing if host not in present]
            waited = f"waited for {', '.join(missing)} to publish for round {number} at {self.url}"
            if left:
                raise RoundIncomplete(f"{', '.join(left)} left the job before publishing ({waited})", missing, left)
            if time.monotonic() >= deadline:
                raise RoundIncomplete(f"no value from {', '.join(missing)} after {timeout_s:g} s ({waited}; "
                                      f"have {', '.join(published) or 'none'})", missing, [])
            if time.monotonic() >= next_report:
                logging.info("round %d: waiting for %s to publish (giving up in %.0fs)", number, ", ".join(missing),
                             deadline - time.monotonic())
                next_report = time.monotonic() + _REPORT_S
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def post(self, number: int, event: dict) -> None:
        """Records `event` (JSON) from this agent in round `number`. Not on the lease: it outlives the agent."""
        if self.host_id is None:
            raise RuntimeError("post() before join(): events are signed with the host id")
        key = self._key("events", self._number(number), self.host_id, uuid.uuid4().hex)
        self._call(f"post an event for round {number}", self._client.put, key, dump(event))

    def events(self, number: int) -> list[tuple[str, dict]]:
        """(host_id, event) of every event posted in round `number`, in the order etcd stored them."""
        found = self._range(f"events/{self._number(number)}/", order="create")
        return [(key.partition("/")[0], json.loads(value)) for key, value in found]

    # Registering on a new lease (its keep-alive: rendezvous_lease.py).

    def _register(self, previous: str | None, stale: bool) -> str | None:
        renewed_at = time.monotonic()
        lease = self._call("grant a lease", self._client.lease, self.ttl_s)
        try:
            why, renewed_at = self._enter(lease, previous, stale, renewed_at)
        except BaseException:
            self._revoke(lease, quietly=True)
            raise
        with self._lock:
            self._lease, self._lost, self._renewed_at = lease, None, renewed_at
            self._stop_keep_alive = stop = threading.Event()
        threading.Thread(target=self._keep_alive, args=(lease.id, stop), daemon=True,
                         name=f"mwloop-rendezvous-{self.host_id}").start()
        return why

    def _enter(self, lease: etcd3gw.Lease, previous: str | None, stale: bool,
               renewed_at: float) -> tuple[str | None, float]:
        """Registers on `lease` in the live generation or a new one (mwloop.launcher.generation); (why a new
        one, when the lease was last renewed)."""
        key, info = self._generation_key(), dump(self._info)
        deadline = renewed_at + self.ttl_s + 1
        while True:
            found = self._read_generation()
            current, revision = found if found else (None, None)
            ended, hosts = None, []
            if current is not None:
                values = self._call("read the job's end", self._client.get, self._key("ended", at=current["id"]))
                ended = json.loads(values[0]) if values else None
                hosts = [host for host, _ in self._range("hosts/", at=current["id"])]
                if current["id"] == previous and ended is not None and not stale:
                    raise JobEnded(f"job {self.job!r} ended while {self.host_id} was away: "
                                   f"{ended.get('line') or 'every worker finished'}", ended["code"])
            why = generation.why_new(self.job, self.url, current, previous, stale, ended, hosts)
            if why is not None:
                new = generation.new_id()
                writes = generation.puts(key, generation.value(new, self._workdir),
                                         self._key("hosts", self.host_id, at=new), info, lease.id)
                if self._txn("start the job's generation", [generation.unchanged(key, revision)], writes):
                    self.generation = new
                    if current is not None:
                        self._call("delete a stale generation", self._client.delete_prefix,
                                   self._key("", at=current["id"]))
                    return why, renewed_at
                continue
            generation.check_workdir(self.job, self.url, current, self._workdir, hosts)
            host_key = self._key("hosts", self.host_id, at=current["id"])
            if self._txn("register", [generation.unchanged(key, revision), generation.absent(host_key)],
                         generation.put_host(host_key, info, lease.id)):
                self.generation = current["id"]
                return None, renewed_at
            if self._read_generation() != found:
                continue
            # The id is taken: a crashed agent's key expires within the TTL.
            if time.monotonic() > deadline:
                raise RendezvousError(f"host id {self.host_id!r} is already in job {self.job!r} at {self.url} "
                                      f"and its lease stays alive: another agent uses that id")
            time.sleep(_POLL_S)
            if self._call("renew the lease", lease.refresh) > 0:  # it must outlive the wait
                renewed_at = time.monotonic()


    # Requests.

    def _call(self, what: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """function(*args, **kwargs), its failures as one-line RendezvousErrors naming the URL."""
        try:
            return function(*args, **kwargs)
        except etcd_errors.ConnectionTimeoutError:
            raise EtcdUnavailable(f"etcd at {self.url} did not answer within {self.request_timeout_s:g} s "
                                  f"({what}): check that it runs and answers there") from None
        except (etcd_errors.ConnectionFailedError, requests.ConnectionError) as e:
            raise EtcdUnavailable(f"cannot reach etcd at {self.url} ({what}: {reason(e)}): check the host and "
                                  "port, that etcd runs there, and that this machine reaches it") from None
        except CALL_ERRORS as e:
            why = reason(e)
            # Expired before the keep-alive noticed: the same as losing it.
            if "lease not found" in why:
                with self._lock:
                    lease_id = self._lease.id if self._lease else 0
                self._set_lost(lease_id, f"etcd at {self.url} expired this agent's lease")
                raise LeaseLost(f"{self.host_id} is not in job {self.job!r} ({what}): {why}") from None
            raise EtcdUnavailable(f"etcd at {self.url} failed to {what}: {why} (is it etcd >= 3.4?)") from None

    def _key(self, *parts: str, at: str | None = None) -> str:
        """A key of generation `at` (default: this agent's, or before it joined the current one, if any)."""
        if at is None:
            at = self.generation
            if at is None:
                found = self._read_generation()
                at = found[0]["id"] if found else "none"
        return f"/mwloop/{self.job}/{at}/" + "/".join(parts)

    def _generation_key(self) -> str:
        return f"/mwloop/{self.job}/generation"

    def _read_generation(self) -> tuple[dict, int] | None:
        """(the generation key's value, its mod revision), or None when etcd has none for the job."""
        found = self._call("read the job's generation", self._client.get, self._generation_key(), metadata=True)
        if not found:
            return None
        value, meta = found[0]
        return json.loads(value), int(meta["mod_revision"])

    def _txn(self, what: str, compare: list[dict], success: list[dict]) -> bool:
        """One etcd transaction: `success`'s writes if every `compare` holds; whether they were made."""
        answer = self._call(what, self._client.transaction, {"compare": compare, "success": success, "failure": []})
        return bool(answer.get("succeeded"))

    @staticmethod
    def _number(number: int) -> str:
        if not isinstance(number, int) or not 0 <= number < 10**_ROUND_DIGITS:
            raise ValueError(f"a round number is an int in [0, 1e{_ROUND_DIGITS}), got {number!r}")
        return f"{number:0{_ROUND_DIGITS}d}"

    def _range(self, prefix: str, order: str = "key", at: str | None = None) -> list[tuple[str, bytes]]:
        """(key after the prefix, value) of every key under the generation's <prefix>, sorted by `order`."""
        full = self._key(prefix, at=at)
        found = self._call(f"read {prefix}", self._client.get_prefix, full, sort_order="ascend", sort_target=order)
        return [(meta["key"].decode()[len(full):], value) for value, meta in found]


def _prefix_end(prefix: str) -> str:
    """The end of etcd's range of keys that start with `prefix` (its last byte + 1: '/' becomes '0')."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)
