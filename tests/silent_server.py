"""A TCP server on 127.0.0.1 that accepts connections and never answers (a hung tracking server), for
tests/test_settings_that_conflict.py and tests/stress/fault_cases_usercode.py.

`python -m tests.silent_server PORTFILE` listens on a free port, writes it to PORTFILE, and holds every
connection open until it is killed.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time


def serve(port_file: str) -> None:
    """Listens, writes the port to `port_file` (atomically: readers poll for it), and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    with open(port_file + ".tmp", "w") as out:
        out.write(str(server.getsockname()[1]))
    os.replace(port_file + ".tmp", port_file)
    held = []
    while True:
        connection, _ = server.accept()
        held.append(connection)  # kept open, unread: the client waits for an answer that never comes


def start_in_thread() -> tuple[int, threading.Thread]:
    """The same server in a daemon thread of this process: (port, thread)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            held.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


if __name__ == "__main__":
    serve(sys.argv[1])
    time.sleep(1e9)
