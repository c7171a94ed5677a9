"""vLLM engine settings through `switchyard serve`: they reach the engine with their
types, and a setting the engine cannot start with fails the start naming it."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import grpc
import pytest
from switchyard.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    generation_pb2,
    generation_pb2_grpc,
)
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from bench.gpu.tp import MULTICAST_OFF, process_envs
from control.fleet.local_workers import free_port
from pyworker.cpu_binding import BIND_ENV, numa_nodes
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


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="two vLLM-CPU ranks need a CPU each; one here"
)
def test_a_model_split_over_two_ranks_serves_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tensor_parallel_size 2 on vLLM-CPU (two ranks, each on its share of the CPUs): every
    stream completes, GetInfo and ListWorkers report the parallel size and the GPUs it was
    given, and the control plane's NCCL settings reach the ranks' own processes."""
    for name, value in MULTICAST_OFF.items():
        monkeypatch.setenv(name, value)
    # vLLM renames its processes (setproctitle), which blanks /proc/PID/environ unless told
    # not to: then what each process was started with stays readable.
    monkeypatch.setenv("SPT_NOENV", "1")
    port = free_port()
    cfg = config(tmp_path, port, "{tensor_parallel_size: 2, max_model_len: 1024}")
    cfg.write_text(cfg.read_text() + "    gpus: [0, 1]\n")
    proc = start_process(["-m", "control", "serve", "--config", str(cfg)], port, tmp_path, "serve")
    try:
        wait_serving(proc, "tiny")
        with grpc.insecure_channel(proc.address) as ch:
            (w,) = (
                admin_pb2_grpc.AdminStub(ch)
                .ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
                .workers
            )
            gen = generation_pb2_grpc.GenerationStub(ch)
            futures = [
                gen.Complete.future(
                    generation_pb2.GenerateRequest(
                        model="tiny",
                        text=f"Hello {i}",
                        stopping=generation_pb2.StoppingParams(max_tokens=6, ignore_eos=True),
                    ),
                    timeout=120,
                )
                for i in range(8)
            ]
            done = [f.result() for f in futures]
        with grpc.insecure_channel(w.address) as ch:
            info = worker_pb2_grpc.WorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        seen = {p["process"]: p["env"] for p in process_envs(proc.popen.pid)}
    finally:
        code = proc.stop(timeout=60)
    log = proc.log_path.read_text()
    assert code == 0, log[-3000:]
    assert [d.final.usage.completion_tokens for d in done] == [6] * 8
    assert {d.final.finish_reason for d in done} == {common_pb2.FinishReason.FINISH_REASON_LENGTH}
    assert (info.tensor_parallel_size, info.pipeline_parallel_size) == (2, 1)
    assert (w.tensor_parallel_size, w.pipeline_parallel_size) == (2, 1)
    assert list(w.gpus) == ["0", "1"] and w.local
    # vLLM's engine core and its two rank processes, below the worker
    assert {"VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"} <= set(seen), seen
    assert all(env == {**MULTICAST_OFF, "CUDA_VISIBLE_DEVICES": "0,1"} for env in seen.values())
    cpus = os.sched_getaffinity(0)
    if BIND_ENV not in os.environ and numa_nodes(cpus) < 2:  # the worker bound the ranks
        assert "CPU ranks bound" in log and f"{BIND_ENV}=" in log
