"""An agent's ports for its round's workers (mwloop/launcher/ports.py): held from the pick until the workers
start, so another agent on the machine picking at the same time gets other ones (a suite run saw two agents
handed one port by portpicker: 2 distinct addresses among a round's 3 workers)."""

from __future__ import annotations

import errno
import socket

import pytest

from mwloop.launcher.ports import HeldPorts


def test_a_held_port_is_handed_to_no_one_else_and_is_free_for_the_worker_once_released():
    with HeldPorts(2) as held:
        assert len(set(held.ports)) == 2
        for port in held.ports:
            other = socket.socket()
            with pytest.raises(OSError) as e:
                other.bind(("", port))
            assert e.value.errno == errno.EADDRINUSE
            other.close()
        # What another agent picking now gets: never a held port.
        with HeldPorts(50) as others:
            assert not set(others.ports) & set(held.ports)
        held.release()
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("", held.ports[0]))  # the worker's server binds it
        server.listen()
        server.close()
