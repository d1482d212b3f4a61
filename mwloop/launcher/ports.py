"""Ports for a round's workers that another agent on the same machine cannot pick meanwhile.

portpicker asks the kernel for a free port and closes it at once, so two agents on one machine that pick at the
start of the same round can be handed the same port (its own docs: without a port server, "duplicate assignments
may occur"); one worker then fails to bind and the round is lost. An agent holds its ports bound from the pick
until its workers start: the kernel hands a bound port to no one else, and closing a socket that never listened
frees its port at once for the worker's server.
"""

from __future__ import annotations

import socket


class HeldPorts:
    """`count` free TCP ports, each held by a bound socket until `release` (or the end of a `with` block)."""

    def __init__(self, count: int):
        self._sockets: list[socket.socket] = []
        try:
            for _ in range(count):
                self._sockets.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                self._sockets[-1].bind(("", 0))
        except BaseException:
            self.release()
            raise
        self.ports = [s.getsockname()[1] for s in self._sockets]

    def release(self) -> None:
        """Frees the ports for the workers about to bind them; safe to call twice."""
        for s in self._sockets:
            s.close()

    def __enter__(self) -> HeldPorts:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
