"""vLLM engine settings through `switchyard serve`: they reach the engine with their
types, and a setting the engine cannot start with fails the start naming it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import grpc
import pytest
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from control.fleet.supervisor import free_port
from tests.procs import serve_startup_failure, start_process, wait_serving

pytestmark = pytest.mark.engine


def config(tmp_path: Path, port: int, engine_args: str) -> Path:
    path = tmp_path / "switchyard.yaml"
    path.write_text(
        f"listen: 127.0.0.1:{port}\n"
        "models:\n"
        "  - name: tiny\n"
        "    engine: vllm\n"
        "    model: builtin:tiny\n"
        f"    engine_args: {engine_args}\n"
    )
    return path


def test_engine_settings_reach_vllm_with_their_types(tmp_path: Path) -> None:
    port = free_port()
    settings = (
        "{enforce_eager: true, max_model_len: 1024, max_num_seqs: 8, seed: 7, "
        "dtype: float32, enable_prefix_caching: true, kv_cache_dtype: auto, "
        "gpu_memory_utilization: 0.5}"
    )
    cfg = config(tmp_path, port, settings)
    proc = start_process(["-m", "control", "serve", "--config", str(cfg)], port, tmp_path, "serve")
    try:
        wait_serving(proc, "tiny")
        with grpc.insecure_channel(proc.address) as ch:
            admin = admin_pb2_grpc.AdminStub(ch)
            deadline = time.monotonic() + 30
            while True:  # KV blocks used and free arrive with the first load report
                workers = admin.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
                w = workers.workers[0]
                if w.kv_blocks_used + w.kv_blocks_free == w.kv_blocks_total > 0:
                    break
                assert time.monotonic() < deadline, f"no load report in ListWorkers: {w}"
                time.sleep(0.1)
            gen = generation_pb2_grpc.GenerationStub(ch)
            done = gen.Complete(
                generation_pb2.GenerateRequest(
                    model="tiny",
                    text="Hello",
                    stopping=generation_pb2.StoppingParams(max_tokens=4, ignore_eos=True),
                ),
                timeout=60,
            )
        (w,) = workers.workers
        assert w.local and w.process == "running"
        assert w.max_context == 1024  # max_model_len reached vLLM
        assert (w.weight_dtype, w.kv_cache_dtype) == ("float32", "float32")
        assert (w.tensor_parallel_size, w.pipeline_parallel_size) == (1, 1)
        assert w.kv_blocks_total > 0 and w.kv_block_size > 0
        assert w.kv_blocks_used + w.kv_blocks_free == w.kv_blocks_total
        if shutil.which("nvidia-smi") is None:
            assert w.gpu_memory_total_bytes == 0  # no GPU here
        assert done.final.usage.completion_tokens == 4
    finally:
        code = proc.stop(timeout=60)
    log = proc.log_path.read_text()
    assert code == 0, log[-3000:]
    assert "'enforce_eager': True" in log or '"enforce_eager": true' in log


@pytest.mark.parametrize(
    ("engine_args", "expected"),
    [
        # A misspelt name, refused before the engine loads, with the nearest name.
        ("{enforce_eagr: true}", ["engine_args.enforce_eagr", "did you mean 'enforce_eager'"]),
        # vLLM's config refuses it: longer than the model's positions.
        ("{max_model_len: 4096}", ["engine_args.max_model_len", "VLLM_ALLOW_LONG_MAX_MODEL_LEN"]),
        # The engine core refuses it while it starts: too little KV cache for one sequence.
        (
            "{kv_cache_memory_bytes: 2097152}",
            [
                "engine_args.kv_cache_memory_bytes / engine_args.gpu_memory_utilization",
                "To serve at least one request",
            ],
        ),
    ],
    ids=["unknown-name", "max-model-len", "kv-cache-too-small"],
)
def test_a_setting_the_engine_refuses_fails_the_start_naming_it(
    tmp_path: Path, engine_args: str, expected: list[str]
) -> None:
    failed = serve_startup_failure(config(tmp_path, free_port(), engine_args))
    for text in expected:
        assert text in failed, failed
    assert "model tiny:" in failed
