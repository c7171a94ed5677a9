"""The transport edge as a hostile client reaches it: what no well-behaved gRPC client
sends (malformed headers over raw HTTP/2, HTTP/1.1, random bytes, a broken TLS
handshake, connections opened and dropped). Each attempt returns what the client saw, in
a word: a gRPC status code's name, or CLOSED when the server closed the connection."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

import grpc
import h2.config
import h2.connection
import h2.events
from switchyard.v1 import generation_pb2

SOCKET_TIMEOUT_S = 10.0
LIST_MODELS = "/switchyard.v1.Generation/ListModels"
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def attempts(default: int) -> int:
    """Attempts per kind: SWITCHYARD_EDGE_ATTEMPTS (the full run: 10000 in all)."""
    return int(os.environ.get("SWITCHYARD_EDGE_ATTEMPTS", default))


def grpc_frame(body: bytes) -> bytes:
    return struct.pack(">BI", 0, len(body)) + body


@dataclass
class H2Answer:
    status: str  # the grpc-status code's name; CLOSED: no status before the connection ended
    message: str = ""


def h2_call(
    host: str, port: int, path: str, headers: list[tuple[str, str]], body: bytes
) -> H2Answer:
    """One gRPC call over a fresh plaintext HTTP/2 connection with exactly these extra
    headers: what a client library would refuse to send."""
    with socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S) as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(
            stream,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", f"{host}:{port}"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *headers,
            ],
        )
        conn.send_data(stream, grpc_frame(body), end_stream=True)
        sock.sendall(conn.data_to_send())
        fields: dict[str, str] = {}
        while True:
            data = sock.recv(65536)
            if not data:
                return H2Answer("CLOSED")
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    fields.update(
                        (_text(k), _text(v))
                        for k, v in event.headers  # type: ignore[attr-defined]
                    )
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, stream)  # type: ignore[arg-type]
                elif isinstance(event, h2.events.StreamReset):
                    return H2Answer(f"RST_STREAM({event.error_code})")
                elif isinstance(event, h2.events.ConnectionTerminated):
                    return H2Answer("CLOSED")
                if isinstance(event, h2.events.StreamEnded) or "grpc-status" in fields:
                    if "grpc-status" in fields:
                        return H2Answer(
                            _code_name(int(fields["grpc-status"])), fields.get("grpc-message", "")
                        )
            sock.sendall(conn.data_to_send())


def _code_name(number: int) -> str:
    return next(c.name for c in grpc.StatusCode if c.value[0] == number)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def send_raw(host: str, port: int, payload: bytes) -> str:
    """Write `payload` on a fresh connection, end the client's side, and read until the
    server closes it (it may answer first: HTTP/1.1 gets a 400-ish reply or a GOAWAY)."""
    with socket.create_connection((host, port), timeout=SOCKET_TIMEOUT_S) as sock:
        try:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass  # closed with unread bytes in its buffer: a reset, still a close
    return "CLOSED"


def list_models_body() -> bytes:
    return generation_pb2.ListModelsRequest().SerializeToString()
