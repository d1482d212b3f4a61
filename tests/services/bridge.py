"""Machines on this one, for the elastic agents' test: network namespaces on a private bridge; links go down.

Each namespace has its own loopback and one interface (`eth0`, a veth pair's end) on a bridge in the test's own
namespace, on a private /24 that routes nowhere: the bridge holds .1 (where the test's etcd listens), machine i
holds .(10 + i). `cut(i)` sets the machine's link down (its host side), as a pulled cable or a lost rack switch
would; `mend(i)` sets it up again. Needs root (ip netns, ip link); everything is removed by `close()`, and every
name carries the test process's pid so parallel tests never meet.
"""

from __future__ import annotations

import os
import subprocess

from tests.services import ServiceError


def _ip(*args: str) -> None:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if run.returncode:
        raise ServiceError(f"ip {' '.join(args)} failed: {run.stderr.strip()} (the namespaces' test needs root and "
                           f"iproute2)")


class Bridge:
    """`count` namespaces on one bridge (see the module docstring)."""

    def __init__(self, count: int):
        tag = os.getpid() % 100_000
        self.bridge, self.subnet = f"mwbr{tag}", f"10.{200 + tag % 50}.{tag % 250}"
        self.names = [f"mw{tag}m{i}" for i in range(count)]
        self._made: list[tuple[str, ...]] = []  # what close() removes, newest first
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", "del", self.bridge))
            _ip("addr", "add", f"{self.host}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, name in enumerate(self.names):
                _ip("netns", "add", name)
                self._made.append(("netns", "del", name))
                _ip("link", "add", self._veth(i), "type", "veth", "peer", "name", "eth0", "netns", name)
                self._made.append(("link", "del", self._veth(i)))
                _ip("link", "set", self._veth(i), "master", self.bridge, "up")
                for args in (("addr", "add", f"{self.address(i)}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                             ("link", "set", "lo", "up")):
                    _ip("-n", name, *args)
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        """The bridge's address: the test's own side, where etcd listens."""
        return f"{self.subnet}.1"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def _veth(self, i: int) -> str:
        return f"{self.bridge}v{i}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on machine i."""
        return ["ip", "netns", "exec", self.names[i]]

    def cut(self, i: int) -> None:
        _ip("link", "set", self._veth(i), "down")

    def mend(self, i: int) -> None:
        _ip("link", "set", self._veth(i), "up")

    def close(self) -> None:
        for args in reversed(self._made):
            subprocess.run(["ip", *args], capture_output=True, timeout=30)  # best effort: a veth goes with its netns
        self._made = []
