"""Servers that stand at a ``--ray-address`` in tests: one that answers HTTP/2's handshake as a gRPC
server (Ray's GCS) does, a web server, and a silent listener.  A real GCS is checked against
``ray_address_problem`` in tests/e2e/test_up_front_checks_e2e.py."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

SETTINGS_FRAME = bytes([0, 0, 0, 0x04, 0, 0, 0, 0, 0])
"""An empty HTTP/2 SETTINGS frame: what a gRPC server sends first (RFC 9113, 3.4)."""


@contextlib.contextmanager
def answering(reply: bytes | None) -> Iterator[str]:
    """``127.0.0.1:<port>`` of a listener that sends ``reply`` to each connection after reading its
    first bytes (None: says nothing until the connection is closed)."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):
                    conn.recv(64)
                    if reply is not None:
                        conn.sendall(reply)
                    else:
                        stop.wait(30.0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        server.close()


def grpc_like() -> contextlib.AbstractContextManager[str]:
    """A listener that answers HTTP/2's preface with a SETTINGS frame, as Ray's GCS does."""
    return answering(SETTINGS_FRAME)


def web_server() -> contextlib.AbstractContextManager[str]:
    """A listener that answers as an HTTP/1 server does to a request it cannot parse."""
    return answering(b"HTTP/1.0 400 Bad request\r\n\r\n")
