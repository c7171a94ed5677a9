"""The `switchyard` CLI's default address (switchyard/client/cli.py); the CLI against a real
control plane: tests/integration/clients/test_cli.py."""

from __future__ import annotations


def test_default_address_is_where_serve_listens() -> None:
    # The CLI lives in the client package, which imports nothing of the server's: its
    # default --address is a copy of the server's default listen address.
    from control.config import DEFAULT_LISTEN
    from switchyard.client.cli import DEFAULT_ADDRESS

    assert DEFAULT_ADDRESS == DEFAULT_LISTEN
