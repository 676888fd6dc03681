"""Loopback ports for tests that start servers or process groups (importable from every test folder: the suite's
root conftest puts tests/ on the import path)."""

import socket

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on loopback now, never one this process handed out before (a test that asks twice, for the
    process group's store and a metrics server, must not get one port for both)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
