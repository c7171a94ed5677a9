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


def bind(server: Any, address: str) -> int:
    """`server.add_insecure_port(address)`, with one clear error when it cannot bind."""
    try:
        port: int = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises "Failed to bind to address ..."
        raise port_in_use(address) from exc
    if port == 0:  # older grpcio reports failure as port 0
        raise port_in_use(address)
    return port


def check_free(host: str, port: int) -> None:
    """Fail now if something listens on host:port (port 0 is always free). For a process
    that would otherwise spend minutes loading an engine before it binds."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Like gRPC: connections of an earlier process in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError as exc:
            shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
            raise port_in_use(shown) from exc
