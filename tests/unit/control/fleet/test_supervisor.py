"""How the supervisor turns a model spec into a worker command line."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from control.config import ModelSpec
from control.fleet import local_workers
from control.fleet.local_workers import cpp_worker_binary, free_port, worker_command
from control.text.tokenizer import Tokenizer


def test_vllm_worker_command() -> None:
    spec = ModelSpec(
        name="m",
        engine="vllm",
        model="/m",
        engine_args={"max_model_len": 1024, "enforce_eager": True},
    )
    assert worker_command(spec, "/m", 7001) == [
        sys.executable,
        "-m",
        "pyworker",
        "--model",
        "/m",
        "--port",
        "7001",
        "--engine-args",
        '{"enforce_eager": true, "max_model_len": 1024}',
    ]


def test_sim_worker_takes_vocabulary_and_eos_from_the_tokenizer(tiny_model_dir: Path) -> None:
    tok = Tokenizer(str(tiny_model_dir))
    spec = ModelSpec(name="s", engine="sim", model="builtin:tiny", engine_args={"kv_blocks": 64})
    cmd = worker_command(spec, str(tiny_model_dir), 7002, tok)
    assert cmd[:5] == [cpp_worker_binary(), "--engine", "sim", "--model", str(tiny_model_dir)]
    args = dict(zip(cmd[5::2], cmd[6::2], strict=True))
    assert args == {
        "--port": "7002",
        "--sim-eos-id": "1",
        "--sim-kv-blocks": "64",
        "--sim-vocab-size": "512",
    }


def test_trtllm_worker_takes_its_eos_ids_from_the_engine_and_tokenizer(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tok = Tokenizer(str(tiny_model_dir))
    spec = ModelSpec(
        name="t",
        engine="trtllm",
        model=str(tmp_path),
        tokenizer=str(tiny_model_dir),
        engine_args={"max_batch_size": 8},
    )
    cmd = worker_command(spec, str(tmp_path), 7003, tok)
    assert cmd[:5] == [cpp_worker_binary(), "--engine", "trtllm", "--model", str(tmp_path)]
    args = dict(zip(cmd[5::2], cmd[6::2], strict=True))
    # No lone --eos-id: it would override generation_config.json's full EOS set.
    assert args == {
        "--port": "7003",
        "--max-batch-size": "8",
        "--tokenizer": str(tiny_model_dir),
        "--vocab-size": "512",
    }


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may offer one free port twice in a row; a second worker started before
    the first has bound must not be given it (two workers on one port, one fails)."""
    offered = iter([0, 0, 1])
    base = free_port()  # a real free port, so the fake's ports are unlikely to be handed out

    class OneOffer:
        def __init__(self, *args: Any) -> None:
            self.port = base + 10 + next(offered)

        def __enter__(self) -> OneOffer:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(local_workers.socket, "socket", OneOffer)
    first, second = free_port(), free_port()
    assert (first, second) == (base + 10, base + 11)


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
