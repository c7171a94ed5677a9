"""The `switchyard` CLI (`switchyard/client/cli.py`), on the client library, against a real
control plane with tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import Proc, serving_control

TOKEN = "cli-test-secret-0123456789abc"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("cli")
    tokens = tmp / "tokens.yaml"
    tokens.write_text(f"tokens: [{{name: cli, token: {TOKEN}, scopes: [generate, admin]}}]\n")
    models = "  - {name: sim, engine: sim, model: builtin:tiny, replicas: 2}\n"
    settings = f"auth: {{tokens_file: {tokens}}}\n"
    with serving_control(tmp, models, "sim", settings=settings, timeout=120) as proc:
        yield proc


def cli(plane: Proc, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if token:
        env["SWITCHYARD_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "control", args[0], "--address", plane.address, *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def test_generate_complete_tokenize_models(plane: Proc) -> None:
    out = cli(plane, "generate", "--model", "sim", "--max-tokens", "5", "--ignore-eos", "Hi")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "[LENGTH] 5 tokens" in out.stderr
    out = cli(plane, "complete", "--model", "sim", "--max-tokens", "3", "--ignore-eos", "Hi")
    assert out.returncode == 0 and "[LENGTH] 3 tokens" in out.stderr, out.stderr
    out = cli(plane, "tokenize", "--model", "sim", "Hello")
    assert out.returncode == 0 and all(t.isdigit() for t in out.stdout.split()), out.stderr
    out = cli(plane, "models")
    assert out.returncode == 0 and out.stdout.startswith("sim\t"), out.stderr
    assert "2/2 workers healthy" in out.stdout


def test_errors_name_the_status_and_the_field(plane: Proc) -> None:
    out = cli(plane, "generate", "--model", "sim", "--temperature", "-1", "Hi")
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "sampling.temperature:" in out.stderr
    out = cli(plane, "models", token=None)
    assert out.returncode == 1 and "UNAUTHENTICATED" in out.stderr
    # Structured output reaches the service (the simulator takes none) ...
    out = cli(plane, "complete", "--model", "sim", "--regex", "[a-z]+", "Hi")
    assert out.returncode == 1
    assert "FAILED_PRECONDITION" in out.stderr and "constraint.regex" in out.stderr
    # ... and so does beam search, refused before any worker on an engine without it ...
    out = cli(plane, "complete", "--model", "sim", "--beam-width", "2", "Hi")
    assert out.returncode == 1 and "FAILED_PRECONDITION" in out.stderr, out.stderr
    assert "beam_width: " in out.stderr and "has no beam search" in out.stderr, out.stderr
    # ... one structured-output kind at a time.
    out = cli(plane, "complete", "--model", "sim", "--regex", "a", "--choice", "b", "Hi")
    assert out.returncode == 1 and "not regex, choice" in out.stderr, out.stderr


def test_admin_commands_show_progress(plane: Proc) -> None:
    out = cli(plane, "workers", "--json")
    assert out.returncode == 0, out.stderr
    workers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(workers) == 2 and all(w["model"] == "sim" for w in workers)
    out = cli(plane, "workers")
    assert out.returncode == 0 and out.stdout.count("\ttp 1 x pp 1\n") == 2, out.stdout
    out = cli(
        plane, "load", "placed", "--engine", "sim", "--model-path", "builtin:tiny", "--gpus", "0"
    )
    assert out.returncode == 1 and "spec.gpus" in out.stderr, out.stderr
    assert "the sim engine runs on no GPU" in out.stderr
    out = cli(
        plane, "load", "extra", "--engine", "sim", "--model-path", "builtin:tiny",
        "--engine-args", '{"decode_step_us": 500}',
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "loading extra ..." in out.stderr and "loading extra ... done in" in out.stderr
    assert "extra: 1 workers serving" in out.stdout
    out = cli(plane, "complete", "--model", "extra", "--max-tokens", "2", "--ignore-eos", "Hi")
    assert out.returncode == 0, out.stderr
    victim = workers[0]["address"]
    out = cli(plane, "drain", victim, "--grace", "5")
    assert out.returncode == 0 and f"{victim}: drained" in out.stdout, out.stderr
    out = cli(plane, "unload", "extra", "--grace", "5")
    assert out.returncode == 0 and "extra: unloaded" in out.stdout, out.stderr
    out = cli(plane, "load", "bad", "--engine", "sim", "--model-path", "x", "--engine-args", "[")
    assert out.returncode == 2 and "--engine-args" in out.stderr


def test_adapter_commands(plane: Proc, tmp_path: Path) -> None:
    """LoRA adapters from the CLI, on the simulator (which has LoRA and checks the rank
    of a PEFT adapter directory)."""
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    out = cli(plane, "adapter-load", "sim", "tenant-a", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "loading adapter tenant-a ... done in" in out.stderr
    assert "sim/tenant-a: rank 8 on 2 workers" in out.stdout
    out = cli(plane, "adapters", "--model", "sim")
    assert out.returncode == 0 and f"sim/tenant-a: rank 8, {tmp_path}, on " in out.stdout
    args = ["--model", "sim", "--max-tokens", "12", "--ignore-eos", "Hi"]
    base = cli(plane, "complete", *args)
    tuned = cli(plane, "complete", "--adapter", "tenant-a", *args)
    assert base.returncode == 0 and tuned.returncode == 0, tuned.stderr
    assert tuned.stdout != base.stdout
    out = cli(plane, "adapter-unload", "sim", "tenant-a", "--grace", "5")
    assert out.returncode == 0 and "sim/tenant-a: unloaded" in out.stdout, out.stderr
    out = cli(plane, "complete", "--adapter", "tenant-a", *args)
    assert out.returncode == 1 and "NOT_FOUND" in out.stderr and "tenant-a" in out.stderr
