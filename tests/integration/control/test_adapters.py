"""LoRA adapters through the control plane on the real vLLM CPU worker: small adapters
for the tiny model made here with `peft`, loaded and unloaded at run time with the Admin
API. Greedy output with an adapter differs from the base model's and from another
adapter's, and is the same on every call; an unknown adapter is NOT_FOUND; unloading an
adapter in use waits for its requests; a model whose engine has no LoRA refuses one
before any worker is called."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from switchyard.client import Client, FailedPrecondition, InvalidArgument
from switchyard.client.errors import NotFound, SwitchyardError
from switchyard_common.tinyadapter import make_tiny_adapter
from tests.procs import Proc, serving_control

LORA_ARGS = '{"enable_lora": true, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 3}'
GREEDY: dict[str, Any] = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_tiny_adapter(root / "a", seed=1, model_dir=tiny_model_dir),
        "b": make_tiny_adapter(root / "b", seed=2, model_dir=tiny_model_dir),
        "wide": make_tiny_adapter(root / "wide", seed=3, rank=16, model_dir=tiny_model_dir),
    }


@pytest.fixture(scope="module")
def plane(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    models = (
        f"  - {{name: tiny, engine: vllm, model: {tiny_model_dir}, engine_args: {LORA_ARGS}}}\n"
        "  - {name: sim, engine: sim, model: builtin:tiny, engine_args: {max_loras: 0}}\n"
        "  - {name: sim-lora, engine: sim, model: builtin:tiny,"
        " engine_args: {max_lora_rank: 8, decode_step_us: 5000}}\n"
    )
    log_dir = tmp_path_factory.mktemp("lora")
    with serving_control(log_dir, models, "tiny", "sim", "sim-lora") as p:
        yield p


def greedy(client: Client, adapter: str = "") -> tuple[tuple[int, ...], str]:
    done = client.complete("tiny", "The", adapter=adapter, **GREEDY)
    assert done.final.adapter == adapter
    return done.token_ids, done.text


def unload_while_streaming(
    client: Client, model: str, adapter: str, grace_s: float, **options: Any
) -> tuple[list[Any], Any]:
    """UnloadAdapter while a long stream (1200 tokens) uses the adapter: the stream's
    finals, and what the unload said."""
    started = threading.Event()
    finals: list[Any] = []

    def stream() -> None:
        call = client.generate(
            model, "The", adapter=adapter, max_tokens=1200, ignore_eos=True, **options
        )
        for _ in call:
            started.set()
        finals.append(call.final)

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(120), "the stream never started"
    unloaded = client.unload_adapter(model, adapter, grace_s=grace_s)
    reader.join(60)
    return finals, unloaded


def test_capabilities_declare_lora(plane: Proc) -> None:
    with grpc.insecure_channel(plane.address) as ch:
        listed = generation_pb2_grpc.GenerationStub(ch).ListModels(
            generation_pb2.ListModelsRequest(), timeout=30
        )
    caps = {m.name: m.capabilities for m in listed.models}
    assert caps["tiny"].lora and caps["tiny"].max_loras == 2 and caps["tiny"].max_lora_rank == 8
    assert not caps["sim"].lora
    assert caps["sim-lora"].lora and caps["sim-lora"].max_lora_rank == 8


def test_adapters_change_greedy_output_the_same_way_every_time(
    plane: Proc, adapters: dict[str, Path]
) -> None:
    with Client(plane.address, timeout=120) as client:
        base = greedy(client)
        with pytest.raises(NotFound) as missing:
            greedy(client, "a")
        assert missing.value.resource == ("adapter", "a")
        loaded = client.load_adapter("tiny", "a", str(adapters["a"]))
        assert loaded.adapter.rank == 8 and len(loaded.adapter.workers) == 1
        client.load_adapter("tiny", "b", str(adapters["b"]))
        with_a = greedy(client, "a")
        with_b = greedy(client, "b")
        assert with_a[0] != base[0] and with_b[0] != base[0] and with_a[0] != with_b[0]
        for _ in range(3):  # the same greedy answer, call after call, mixed with others
            assert greedy(client, "a") == with_a
            assert greedy(client) == base
            assert greedy(client, "b") == with_b
        streamed = list(client.generate("tiny", "The", adapter="a", **GREEDY))
        assert tuple(t for c in streamed for t in c.token_ids) == with_a[0]
        assert client.load_adapter("tiny", "a", str(adapters["a"])).adapter.name == "a"  # again
        with pytest.raises(SwitchyardError) as clash:
            client.load_adapter("tiny", "a", str(adapters["b"]))
        assert clash.value.code == grpc.StatusCode.ALREADY_EXISTS
        listed = {a.name: a for a in client.adapters("tiny")}
        assert set(listed) == {"a", "b"} and listed["a"].path == str(adapters["a"])
        client.unload_adapter("tiny", "b")
        with pytest.raises(NotFound):
            greedy(client, "b")


def test_bad_adapters_are_refused_naming_the_field(
    plane: Proc, adapters: dict[str, Path], tmp_path: Path
) -> None:
    with Client(plane.address, timeout=120) as client:
        with pytest.raises(InvalidArgument) as wide:
            client.load_adapter("tiny", "wide", str(adapters["wide"]))
        assert wide.value.violations[0].field == "path"
        assert "max_lora_rank 8" in wide.value.violations[0].description
        with pytest.raises(InvalidArgument) as nowhere:
            client.load_adapter("tiny", "nowhere", str(tmp_path / "missing"))
        assert nowhere.value.violations[0].field == "path"
        with pytest.raises(InvalidArgument) as badname:
            client.load_adapter("tiny", "no spaces", str(adapters["a"]))
        assert badname.value.violations[0].field == "name"
        with pytest.raises(FailedPrecondition) as no_lora:
            client.load_adapter("sim", "a", str(adapters["a"]))
        assert "no LoRA" in no_lora.value.message
        with pytest.raises(FailedPrecondition) as refused:
            client.complete("sim", "The", adapter="a", max_tokens=4)
        assert [v.field for v in refused.value.violations] == ["adapter"]
        with pytest.raises(NotFound):
            client.unload_adapter("tiny", "never-loaded")
        with pytest.raises(InvalidArgument) as grace:
            client.unload_adapter("tiny", "never-loaded", grace_s=-1)
        assert grace.value.violations[0].field == "grace_s"
        assert "wide" not in {a.name for a in client.adapters()}


def test_unloading_an_adapter_in_use_waits_for_its_requests(
    plane: Proc, adapters: dict[str, Path]
) -> None:
    with Client(plane.address, timeout=180) as client:
        client.load_adapter("tiny", "slow", str(adapters["a"]))
        finals, unloaded = unload_while_streaming(client, "tiny", "slow", 120, temperature=0.0)
        # Unload returned after the request ended on its own, whole.
        assert finals and finals[0].finish_reason == "length", finals
        assert finals[0].adapter == "slow" and finals[0].usage.completion_tokens == 1200
        assert unloaded.drained_requests == 1 and unloaded.cancelled_requests == 0
        with pytest.raises(NotFound):
            greedy(client, "slow")
        assert "slow" not in {a.name for a in client.adapters("tiny")}


def test_the_cpp_worker_takes_adapters_the_same_way(plane: Proc, adapters: dict[str, Path]) -> None:
    """The C++ worker on its simulator: the adapter (a PEFT directory; its rank checked)
    gives a token stream of its own, the same every time; the same refusals; an unload
    waits for the adapter's requests."""
    options: dict[str, Any] = {"max_tokens": 16, "ignore_eos": True, "temperature": 0.0}
    with Client(plane.address, timeout=120) as client:
        base = client.complete("sim-lora", "The", **options).token_ids
        with pytest.raises(NotFound):
            client.complete("sim-lora", "The", adapter="a", **options)
        assert client.load_adapter("sim-lora", "a", str(adapters["a"])).adapter.rank == 8
        done = client.complete("sim-lora", "The", adapter="a", **options)
        assert done.token_ids != base and done.final.adapter == "a"
        assert (
            client.complete("sim-lora", "The", adapter="a", **options).token_ids == done.token_ids
        )
        streamed = list(client.generate("sim-lora", "The", adapter="a", **options))
        assert tuple(t for c in streamed for t in c.token_ids) == done.token_ids
        with pytest.raises(InvalidArgument) as wide:
            client.load_adapter("sim-lora", "wide", str(adapters["wide"]))
        assert wide.value.violations[0].field == "path"
        assert "max_lora_rank 8" in wide.value.violations[0].description

        # 1200 tokens at 5 ms a step: 6 s
        finals, unloaded = unload_while_streaming(client, "sim-lora", "a", 60)
        assert finals and finals[0].finish_reason == "length" and finals[0].adapter == "a"
        assert unloaded.drained_requests == 1 and unloaded.cancelled_requests == 0
        with pytest.raises(NotFound):
            client.complete("sim-lora", "The", adapter="a", **options)
