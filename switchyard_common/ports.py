"""Listening ports that belong to one process.

gRPC servers set SO_REUSEPORT by default, so a second server started on a port that one
already serves listens too, and the kernel splits connections between them without a
word. Every Switchyard server turns it off (`SERVER_OPTIONS`) and fails at start with
"port in use"; only the control plane's router processes share a port, on purpose.
"""

from __future__ import annotations

import socket
from typing import Any

NO_REUSEPORT = ("grpc.so_reuseport", 0)


def port_in_use(address: str) -> OSError:
    return OSError(f"cannot listen on {address}: port in use (or not permitted)")


def bind(server: Any, address: str, credentials: Any = None) -> int:
    """`server.add_insecure_port(address)` (or `add_secure_port` with `credentials`), with
    one clear error when it cannot bind."""
    try:
        if credentials is None:
            port: int = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpcio raises "Failed to bind to address ..."
        raise port_in_use(address) from exc
    if port == 0:  # older grpcio reports failure as port 0
        raise port_in_use(address)
    return port


class Reservation:
    """Holds host:port for a process that binds it later (a vLLM worker, after minutes of
    engine start): a bound socket that does not listen, so no other bind, nor the kernel
    picking a port for someone's outgoing connection, takes the port meanwhile. Raises
    "port in use" at once when something listens there. `release()` just before the real
    bind."""

    def __init__(self, host: str, port: int) -> None:
        self._socket: socket.socket | None = None
        if port == 0:
            return
        bare = host.strip("[]")
        family = socket.AF_INET6 if ":" in bare else socket.AF_INET
        shown = f"[{bare}]:{port}" if family == socket.AF_INET6 else f"{bare}:{port}"
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            try:
                s.bind((bare, port))  # without SO_REUSEADDR: nobody else may bind it
            except OSError:
                # Maybe only connections of an earlier process in TIME_WAIT (a restart on
                # the same port): those do not count, as for gRPC's own bind.
                s.close()
                s = socket.socket(family, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((bare, port))
        except OSError as exc:
            s.close()
            raise port_in_use(shown) from exc
        self._socket = s

    def release(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def check_free(host: str, port: int) -> None:
    """Fail now if something listens on host:port (port 0 is always free)."""
    Reservation(host, port).release()
