"""The etcd side of the rendezvous (mwloop.launcher.rendezvous): its one-line errors, the URL form, a client
that trusts no proxy, and etcd3gw's failures as the reason a user can act on."""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors

from mwloop.errors import UserError

URL_FORM = "etcd://HOST:PORT/JOB"
DEFAULT_PORT = 2379  # etcd's own client port
# A job or host id is one key segment: no '/', nothing to escape.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# ValueError: an answer that is not JSON.
CALL_ERRORS = (etcd_errors.Etcd3Exception, requests.RequestException, ValueError, KeyError)


class RendezvousError(RuntimeError):
    """A rendezvous operation that failed, as one line for the user (no traceback)."""


class EtcdUnavailable(RendezvousError):
    """etcd did not answer: refused, timed out, or not etcd's v3 gateway."""


class StoreLost(RendezvousError):
    """etcd no longer holds the job's state as this agent knew it: wiped, restored from an older backup, or
    taken over by a new job under the name (after this one had no agent left)."""


class JobEnded(RendezvousError):
    """The job ended (its verdict, `code` and `line`) while this agent was away from it."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class LeaseLost(RendezvousError):
    """This agent's lease is gone, so it has left the job (its keys went with it) until it calls `rejoin()`."""


class RoundIncomplete(RendezvousError):
    """`gather` gave up: `missing` did not publish in time, or `left` (in missing too) left the job first."""

    def __init__(self, message: str, missing: list[str], left: list[str]):
        super().__init__(message)
        self.missing, self.left = missing, left


def parse_url(url: str) -> tuple[str, int, str]:
    """(host, port, job) of etcd://HOST[:PORT]/JOB (port 2379 when left out); UserError naming the form if not."""
    parsed = urllib.parse.urlsplit(url)
    try:
        port = DEFAULT_PORT if parsed.port is None else parsed.port
    except ValueError:  # not a number, or not 0-65535
        port = 0
    job = parsed.path[1:]
    if (parsed.scheme != "etcd" or not parsed.hostname or not port or not NAME.fullmatch(job)
            or parsed.query or parsed.fragment or parsed.username is not None):
        raise UserError(f"bad rendezvous URL {url!r}: expected {URL_FORM}, e.g. etcd://10.0.0.5:2379/resnet "
                        "(JOB: letters, digits, '.', '_', '-')")
    return parsed.hostname, port, job


def client(host: str, port: int, timeout_s: float) -> etcd3gw.Etcd3Client:
    session = requests.Session()
    # No HTTP(S)_PROXY from the environment: etcd is on the cluster's own network, and a proxy meant for the
    # internet would carry (or block) its traffic.
    session.trust_env = False
    # api_path fixed (etcd >= 3.4): no discovery request first, one round trip fewer that could hang.
    return etcd3gw.client(host=host, port=port, timeout=timeout_s, api_path="/v3/", session=session)


def dump(value: Any) -> bytes:
    # ASCII (json.dumps' default): etcd3gw encodes str values as latin-1.
    return json.dumps(value, sort_keys=True).encode()


def reason(error: Exception) -> str:
    """The useful part of an etcd3gw error: etcd's message, or the OS reason (etcd3gw's str() is just the
    HTTP reason, or empty)."""
    detail = str(getattr(error, "detail_text", None) or error)
    if isinstance(error, (etcd_errors.ConnectionTimeoutError, requests.Timeout)):
        return "timed out"
    try:
        return str(json.loads(detail)["message"])
    except (ValueError, KeyError, TypeError):
        os_reason = re.search(r"\[Errno -?\d+\] [^'\")]+", detail)
        return os_reason[0] if os_reason else (detail.splitlines() or [type(error).__name__])[0][:200]
