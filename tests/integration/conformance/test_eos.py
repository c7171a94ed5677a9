"""Generations that end on the model's EOS (not `ignore_eos`), the same on every worker.

vLLM streams the EOS token as the last output token and counts it in completion_tokens; the
stop reason names it. TensorRT-LLM's samplers leave the end id out of the output, and the
C++ worker puts it back, so the wire looks the same. Run on the vLLM worker, on the C++
worker's simulator in vLLM's convention, and on the simulator in TensorRT-LLM's
(`--sim-eos-convention trtllm`), which exercises the worker's correction.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

from control.fleet.local_workers import cpp_worker_binary, free_port
from tests.integration.conformance.conftest import SIM_ARGS
from tests.integration.conformance.test_generate_stream import Session
from tests.integration.conformance.test_worker_conformance import PROMPT, generate
from tests.procs import Proc, start_process, wait_serving

pytestmark = pytest.mark.engine
FR = common_pb2.FinishReason
EOS = 1  # the tiny model's, and the simulator's as the conformance suite sets it up
MAX_TOKENS = 64


def start_sim(tmp: Path, convention: str) -> Proc:
    port = free_port()
    args = ["--engine", "sim", "--model", "sim-tiny", "--port", str(port), *SIM_ARGS]
    args += ["--sim-eos-every", "16", "--sim-eos-convention", convention]
    proc = start_process(args, port, tmp, f"eos-{convention}", executable=cpp_worker_binary())
    wait_serving(proc, timeout=30)
    return proc


@pytest.fixture(scope="module", params=["vllm", "sim", "sim-trtllm-eos"])
def eos_worker(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Proc]:
    if request.param == "vllm":
        yield request.getfixturevalue("worker")
        return
    convention = "trtllm" if request.param == "sim-trtllm-eos" else "vllm"
    proc = start_sim(tmp_path_factory.mktemp(request.param), convention)
    try:
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, f"C++ worker exited with {code} on SIGTERM:\n{proc.log_tail()}"


@pytest.fixture(scope="module")
def stub(eos_worker: Proc) -> Iterator[Any]:
    with grpc.insecure_channel(eos_worker.address) as ch:
        yield worker_pb2_grpc.WorkerStub(ch)


def sampled(seed: int, max_tokens: int = MAX_TOKENS, **kw: Any) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        prompt_token_ids=PROMPT,
        max_tokens=max_tokens,
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=seed),
        **kw,
    )


@pytest.fixture(scope="module")
def eos_seed(stub: Any) -> int:
    """A seed whose sampled generation ends on EOS within MAX_TOKENS, on this worker."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        for first in range(0, 256, 16):
            seeds = list(range(first, first + 16))
            outs = list(pool.map(lambda s: generate(stub, sampled(s))[1], seeds))
            for seed, final in zip(seeds, outs, strict=True):
                if final.WhichOneof("stop_reason") == "eos_token_id":
                    return seed
    pytest.fail("no seed in 0..255 ended on EOS within 64 tokens")


def test_eos_is_the_last_token_counted_and_named(stub: Any, eos_seed: int) -> None:
    chunks, final = generate(stub, sampled(eos_seed))
    ids = [t for c in chunks for t in c.token_ids]
    assert final.finish_reason == FR.FINISH_REASON_STOP
    assert final.WhichOneof("stop_reason") == "eos_token_id"
    assert final.eos_token_id == EOS
    assert ids and ids[-1] == EOS and EOS not in ids[:-1]
    assert final.usage.completion_tokens == len(ids) < MAX_TOKENS
    assert final.usage.prompt_tokens == len(PROMPT)


def test_eos_on_generate_stream_is_the_same(stub: Any, eos_seed: int) -> None:
    _, final = generate(stub, sampled(eos_seed))
    session = Session(stub)
    req = sampled(eos_seed)
    req.attempt_id = 7
    session.start(req)
    assert session.ended[7].wait(30), "no final on the stream"
    session.close_and_drain()
    events = session.events[7]
    ids = [t for e in events if e.HasField("chunk") for t in e.chunk.token_ids]
    streamed = events[-1].final
    assert streamed.eos_token_id == final.eos_token_id == EOS
    assert ids[-1] == EOS
    assert streamed.usage.completion_tokens == len(ids) == final.usage.completion_tokens


def test_ignore_eos_goes_past_the_same_eos(stub: Any, eos_seed: int) -> None:
    chunks, _ = generate(stub, sampled(eos_seed))
    ids = [t for c in chunks for t in c.token_ids]
    n = len(ids)
    again_chunks, again = generate(stub, sampled(eos_seed, max_tokens=n + 4, ignore_eos=True))
    again_ids = [t for c in again_chunks for t in c.token_ids]
    assert again.finish_reason == FR.FINISH_REASON_LENGTH
    assert again.usage.completion_tokens == len(again_ids) == n + 4
    # The same tokens before the EOS; the EOS position is where the first run stopped.
    assert again_ids[: n - 1] == ids[:-1]
