"""The C++ worker on its simulator, as the control plane sees it: GetInfo's engine facts,
and StreamLoad still counting KV blocks while requests run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.fleet.local_workers import cpp_worker_binary, free_port
from tests.procs import Proc, start_process, wait_serving

KV_BLOCKS = 2000
BLOCK = 16


@pytest.fixture(scope="module")
def stub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    tmp: Path = tmp_path_factory.mktemp("cpp-load")
    port = free_port()
    args = ["--engine", "sim", "--model", "sim-load", "--port", str(port)]
    args += ["--sim-vocab-size", "512", "--sim-kv-blocks", str(KV_BLOCKS)]
    args += ["--sim-tokens-per-block", str(BLOCK), "--sim-max-batch", "24"]
    args += ["--sim-decode-step-us", "2000"]
    proc: Proc = start_process(args, port, tmp, "cpp-load", executable=cpp_worker_binary())
    try:
        wait_serving(proc, timeout=30)
        with grpc.insecure_channel(proc.address) as ch:
            yield worker_pb2_grpc.WorkerStub(ch)
    finally:
        assert proc.stop() == 0, proc.log_tail()


def test_get_info_reports_the_engines_shape(stub: Any) -> None:
    info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.engine == "sim"
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (1, 1)
    assert (info.kv_block_size, info.kv_blocks_total) == (BLOCK, KV_BLOCKS)
    assert info.max_batch_size == 24
    assert info.max_input_len == info.max_context - 1
    assert info.quantization == ""
    assert (info.gpu_memory_used_bytes, info.gpu_memory_total_bytes) == (0, 0)


def test_stream_load_counts_kv_blocks_under_load(stub: Any) -> None:
    prompt = list(range(10, 42))  # 32 tokens: 2 blocks
    req = worker_pb2.GenerateRequest(
        prompt_token_ids=prompt,
        max_tokens=2000,
        ignore_eos=True,
        sampling=common_pb2.SamplingParams(temperature=0.0),
    )
    calls = [stub.Generate(req, timeout=60) for _ in range(8)]
    load = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=20), timeout=30)
    try:
        for c in calls:
            next(iter(c))  # every request has started
        busy = []
        for report in load:
            if report.running == 8:
                busy.append(report)
            if len(busy) == 5:
                break
        # Each request holds ceil((32 + 2000) / 16) = 127 blocks while it runs.
        for r in busy:
            assert r.kv_blocks_used == 8 * 127
            assert r.kv_blocks_used + r.kv_blocks_free == KV_BLOCKS
            assert r.kv_cache_usage == pytest.approx(8 * 127 / KV_BLOCKS, rel=1e-3)
            assert r.gpu_memory_used_bytes == 0
    finally:
        for c in calls:
            c.cancel()
    deadline = time.monotonic() + 5
    for report in load:
        if report.running == 0 and report.kv_blocks_used == 0:
            assert report.kv_blocks_free == KV_BLOCKS
            break
        assert time.monotonic() < deadline, "KV blocks still held after every request ended"
    load.cancel()
