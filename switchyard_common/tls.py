"""TLS credentials from PEM files, for every Switchyard server and for the control
plane's channels to its workers."""

from __future__ import annotations

from pathlib import Path

import grpc


def _read(what: str, path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise OSError(f"{what}: cannot read {path}: {e.strerror}") from e


def server_pems(
    cert: str, key: str, client_ca: str | None = None, what: str = "tls"
) -> tuple[bytes, bytes, bytes | None]:
    """The PEM bytes of (`cert`, `key`, `client_ca`); `what` names the setting in errors."""
    key_pem = _read(f"{what} key", key)
    cert_pem = _read(f"{what} cert", cert)
    assert key_pem is not None and cert_pem is not None
    return cert_pem, key_pem, _read(f"{what} client_ca", client_ca)


def server_credentials(
    cert: str, key: str, client_ca: str | None = None, what: str = "tls"
) -> grpc.ServerCredentials:
    """TLS with `cert` and `key`; with `client_ca`, mutual TLS (clients must show a
    certificate it signed). `what` names the setting in errors."""
    cert_pem, key_pem, ca = server_pems(cert, key, client_ca, what)
    return grpc.ssl_server_credentials(
        [(key_pem, cert_pem)],
        root_certificates=ca,
        require_client_auth=ca is not None,
    )


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None, what: str = "tls"
) -> grpc.ChannelCredentials:
    """TLS to a server: trust `ca` (None: the system's roots); `cert` and `key` for
    mutual TLS."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(f"{what} ca", ca),
        private_key=_read(f"{what} key", key),
        certificate_chain=_read(f"{what} cert", cert),
    )
