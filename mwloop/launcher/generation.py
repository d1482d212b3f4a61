"""A job's identity in etcd: its *generation*, so that no agent ever reads another job's (or a lost) state.

The key /mwloop/<JOB>/generation holds {"id", "workdir"}; every other key of the job lives under
/mwloop/<JOB>/<id>/ (mwloop.launcher.rendezvous). An agent that joins (`enter`) takes the current generation
when it is live (an agent is in it, it has not ended); it starts a new one, in one etcd transaction with its own
host key, when there is none (a new job, or a wiped etcd), when the last one ended (a job name reused), when
no agent is left in it (a job killed or crashed: its rounds are stale), or when its caller found it stale (etcd
went back in time). Two agents that race to start one: the transaction compares the generation key's revision,
so one wins and the other joins it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from etcd3gw.utils import _encode

from mwloop.errors import UserError


def _put(key: str, value: bytes, lease: int | None = None) -> dict:
    request: dict[str, Any] = {"key": _encode(key), "value": _encode(value)}
    if lease is not None:
        request["lease"] = lease
    return {"request_put": request}


def unchanged(key: str, revision: int | None) -> dict:
    """The compare of a transaction: `key` is as it was read (`revision`: its mod revision; None: absent)."""
    if revision is None:
        return {"key": _encode(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
    return {"key": _encode(key), "result": "EQUAL", "target": "MOD", "mod_revision": revision}


def absent(key: str) -> dict:
    return unchanged(key, None)


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def why_new(job: str, url: str, current: dict | None, previous: str | None, stale: bool, ended: dict | None,
            hosts: list[str]) -> str | None:
    """Why the agent must start a new generation rather than join `current` (None: join it).

    Args:
      current: the generation key's value ({"id", "workdir"}), None when there is none.
      previous: the generation this agent was in (None: a new agent).
      stale: the agent found `previous` went back in time.
      ended: `current`'s verdict, if it ended.
      hosts: the agents in `current` now.
    """
    if current is None:
        return f"a new job {job!r}" if previous is None else lost(job, url, previous)
    if current["id"] == previous:
        return f"etcd at {url} went back in time (generation {previous} lost rounds)" if stale else None
    if ended is not None:
        return (f"the previous job named {job!r} (generation {current['id']}) ended with exit {ended['code']}"
                f"{': ' + ended['line'] if ended.get('line') else ''}; this is a new job")
    if not hosts:
        return (f"the previous job named {job!r} (generation {current['id']}) has no agent left (killed or "
                f"crashed: its rounds are stale); this is a new job")
    return None


def lost(job: str, url: str, previous: str) -> str:
    """Why an agent's generation `previous` is no longer the job's."""
    return (f"etcd at {url} lost the state of job {job!r} (its generation {previous} is gone: etcd was wiped, or "
            f"restored from an older backup)")


def check_workdir(job: str, url: str, current: dict, workdir: str | None, hosts: list[str]) -> None:
    """UserError when a live job under the name trains in another workdir: this agent belongs to another job."""
    theirs = current.get("workdir")
    if workdir and theirs and workdir != theirs:
        raise UserError(f"job {job!r} at {url} is running with --workdir={theirs} (agents: {', '.join(hosts)}); "
                        f"this agent's is {workdir}: give this job a name of its own in --rdzv, or the same --workdir")


def value(generation_id: str, workdir: str | None) -> bytes:
    return json.dumps({"id": generation_id, "workdir": workdir}, sort_keys=True).encode()


def puts(generation_key: str, generation: bytes, host_key: str, host: bytes, lease: int) -> list[dict]:
    """The transaction's writes that start a generation: its key and the first agent's host key."""
    return [_put(generation_key, generation), _put(host_key, host, lease)]


def put_host(host_key: str, host: bytes, lease: int) -> list[dict]:
    return [_put(host_key, host, lease)]
