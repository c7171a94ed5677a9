"""A load generator for streaming LLM APIs over gRPC and HTTP.

Closed loop (a fixed number of concurrent clients, each sending its next request when the
last one ends) or open loop (Poisson arrivals at a rate). Prompt and output lengths come
from a seeded distribution; every request sets ignore_eos so every system generates the
same number of tokens. Per request it records TTFT, inter-token latency, end-to-end
latency, tokens and errors; per run, throughput and p50/p90/p99.

Targets (one small class each): Switchyard's public API, a Switchyard worker called
directly, and an OpenAI-compatible HTTP server (vLLM's, or SMG's).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import grpc


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int = 200
    prompt_len: tuple[int, int] = (128, 128)  # inclusive range
    output_len: tuple[int, int] = (256, 256)
    vocab: tuple[int, int] = (4, 500)  # token ids drawn from this range
    seed: int = 0

    def items(self) -> list[tuple[list[int], int]]:
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.requests):
            n = rng.randint(*self.prompt_len)
            prompt = [rng.randint(*self.vocab) for _ in range(n)]
            out.append((prompt, rng.randint(*self.output_len)))
        return out


@dataclass(slots=True)
class Record:
    start: float
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    tokens: int = 0
    messages: int = 0
    end: float | None = None
    error: str | None = None


class Target(Protocol):
    name: str

    def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        """Yields the number of new tokens in each streamed message."""
        ...

    async def close(self) -> None: ...


class _GrpcTarget:
    """A target behind one gRPC channel (made inside the running event loop)."""

    def __init__(self, address: str, name: str) -> None:
        self.name = name
        self._channel = grpc.aio.insecure_channel(address)

    async def close(self) -> None:
        await self._channel.close(grace=None)


class _HttpTarget:
    def __init__(self, base_url: str, model: str, name: str) -> None:
        import httpx

        self.name = name
        self._client = httpx.AsyncClient(base_url=base_url, timeout=None)
        self._model = model

    async def close(self) -> None:
        await self._client.aclose()


class SwitchyardTarget(_GrpcTarget):
    """switchyard.v1.Generation/Generate (the control plane). With `connections` > 1,
    streams take turns over that many TCP connections, so that several router processes
    on one port (SO_REUSEPORT) all get traffic."""

    def __init__(
        self, address: str, model: str, name: str = "switchyard", connections: int = 1
    ) -> None:
        from switchyard.v1 import generation_pb2, generation_pb2_grpc

        super().__init__(address, name)
        self._pb = generation_pb2
        self._extra = [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(connections - 1)
        ]
        self._stubs = [
            generation_pb2_grpc.GenerationStub(ch) for ch in [self._channel, *self._extra]
        ]
        self._turn = 0
        self._model = model

    async def close(self) -> None:
        for ch in self._extra:
            await ch.close(grace=None)
        await super().close()

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        pb = self._pb
        req = pb.GenerateRequest(
            model=self._model,
            token_ids=pb.TokenIds(ids=prompt),
            stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        self._turn = (self._turn + 1) % len(self._stubs)
        async for msg in self._stubs[self._turn].Generate(req):
            if msg.HasField("chunk"):
                yield len(msg.chunk.token_ids)


class WorkerTarget(_GrpcTarget):
    """switchyard.worker.v1.Worker/Generate (a worker called directly)."""

    def __init__(self, address: str, name: str = "worker") -> None:
        from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

        super().__init__(address, name)
        self._pb = worker_pb2
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        req = self._pb.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True
        )
        async for msg in self._stub.Generate(req):
            if msg.HasField("chunk"):
                yield len(msg.chunk.token_ids)


class WorkerStreamTarget(_GrpcTarget):
    """switchyard.worker.v1.Worker/GenerateStream (a worker called directly, the way the
    control plane calls it): every stream of this client over one GenerateStream, one
    message per engine step."""

    def __init__(self, address: str, name: str = "worker-stream") -> None:
        from switchyard.worker.v1 import worker_pb2, worker_pb2_grpc

        super().__init__(address, name)
        self._pb = worker_pb2
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._queues: dict[int, asyncio.Queue[Any]] = {}
        self._outbox: asyncio.Queue[Any] = asyncio.Queue()
        self._next = 0
        self._reader: asyncio.Task[None] | None = None

    async def _requests(self) -> AsyncIterator[Any]:
        while True:
            first = await self._outbox.get()
            starts = [first]
            while not self._outbox.empty():
                starts.append(self._outbox.get_nowait())
            yield self._pb.StreamRequest(start=starts)

    async def _read(self) -> None:
        try:
            async for msg in self._stub.GenerateStream(self._requests()):
                for event in msg.events:
                    q = self._queues.get(event.attempt_id)
                    if q is not None:
                        q.put_nowait(event)
        except Exception as exc:  # every open stream hears it
            for q in self._queues.values():
                q.put_nowait(exc)

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        self._next += 1
        attempt = self._next
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[attempt] = q
        self._outbox.put_nowait(
            self._pb.GenerateRequest(
                prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, attempt_id=attempt
            )
        )
        try:
            while True:
                event = await q.get()
                if isinstance(event, Exception):
                    raise event
                if event.HasField("chunk"):
                    yield len(event.chunk.token_ids)
                elif event.HasField("error"):
                    raise RuntimeError(f"worker error {event.error.code}: {event.error.message}")
                else:
                    return
        finally:
            del self._queues[attempt]

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        await super().close()


class OpenAIHttpTarget(_HttpTarget):
    """POST /v1/completions with stream=true (vLLM's OpenAI server, SMG's HTTP front)."""

    def __init__(self, base_url: str, model: str, name: str = "openai-http") -> None:
        super().__init__(base_url, model, name)

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        body = {
            "model": self._model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        async with self._client.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in _sse_data(resp):
                event = json.loads(line)
                for choice in event.get("choices", []):
                    ids = choice.get("token_ids")
                    # Servers without token ids send one token per event.
                    n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                    if n:
                        yield n


class VllmGrpcTarget(_GrpcTarget):
    """vLLM's own gRPC server (vllm.grpc.engine.VllmEngine/Generate, smg-grpc-servicer)."""

    def __init__(self, address: str, name: str = "vllm-grpc") -> None:
        from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

        super().__init__(address, name)
        self._pb = vllm_engine_pb2
        self._stub = vllm_engine_pb2_grpc.VllmEngineStub(self._channel)
        self._seq = 0

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        pb = self._pb
        self._seq += 1
        req = pb.GenerateRequest(
            request_id=f"bench-{self._seq}",
            tokenized=pb.TokenizedInput(input_ids=prompt),
            sampling_params=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            stream=True,
        )
        async for msg in self._stub.Generate(req):
            # The closing `complete` repeats the last delta; count chunks only.
            if msg.WhichOneof("response") == "chunk":
                yield len(msg.chunk.token_ids)


class SmgGenerateTarget(_HttpTarget):
    """The SMG gateway's /generate (its /v1/completions takes text prompts only)."""

    def __init__(self, base_url: str, model: str, name: str = "smg") -> None:
        super().__init__(base_url, model, name)

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        body = {
            "model": self._model,
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
            "stream": True,
        }
        seen = 0
        async with self._client.stream("POST", "/generate", json=body) as resp:
            resp.raise_for_status()
            async for line in _sse_data(resp):
                done = json.loads(line).get("meta_info", {}).get("completion_tokens", seen)
                if done > seen:  # cumulative; the last event repeats the last delta
                    yield done - seen
                    seen = done


async def _sse_data(resp: Any) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent-event stream. Lines split on b"\\n" only:
    generated text can hold U+2028 and other characters that str.splitlines breaks on."""
    buf = b""
    async for part in resp.aiter_bytes():
        buf += part
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r")
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                yield line[6:].decode()


async def one_request(target: Target, prompt: list[int], max_tokens: int) -> Record:
    rec = Record(start=time.perf_counter())
    try:
        async for n in target.stream(prompt, max_tokens):
            now = time.perf_counter()
            if rec.ttft is None:
                rec.ttft = now - rec.start
            rec.token_times.append(now)
            rec.tokens += n
            rec.messages += 1
        if rec.tokens != max_tokens:
            rec.error = f"got {rec.tokens} of {max_tokens} tokens"
    except Exception as e:  # a failed request is a data point, not a crash
        rec.error = f"{type(e).__name__}: {e}"[:200]
    rec.end = time.perf_counter()
    return rec


async def closed_loop(target: Target, workload: Workload, concurrency: int) -> list[Record]:
    items = workload.items()
    queue: asyncio.Queue[tuple[list[int], int]] = asyncio.Queue()
    for it in items:
        queue.put_nowait(it)
    records: list[Record] = []

    async def client() -> None:
        while True:
            try:
                prompt, n = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            records.append(await one_request(target, prompt, n))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return records


async def open_loop(target: Target, workload: Workload, rate: float) -> list[Record]:
    rng = random.Random(workload.seed + 1)
    tasks = []
    for prompt, n in workload.items():
        tasks.append(asyncio.create_task(one_request(target, prompt, n)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


@dataclass(frozen=True, slots=True)
class Summary:
    system: str
    mode: str
    load: float  # concurrency, or rate in requests/s
    requests: int
    errors: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    tokens_per_message: float
    first_error: str | None
    # CPU time per output token (µs) by process role, when the benchmark measured it.
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(system: str, mode: str, load: float, records: list[Record]) -> Summary:
    ok = [r for r in records if r.error is None and r.end is not None]
    start = min(r.start for r in records)
    end = max(r.end or r.start for r in records)
    duration = max(end - start, 1e-9)
    tokens = sum(r.tokens for r in ok)
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    itl = [
        (b - a) * 1000 for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)
    ]
    e2e = [(r.end - r.start) * 1000 for r in ok if r.end is not None]

    def pcts(v: Sequence[float]) -> dict[str, float]:
        return {"p50": _pct(v, 50), "p90": _pct(v, 90), "p99": _pct(v, 99)}

    errors = [r.error for r in records if r.error is not None]
    return Summary(
        system=system,
        mode=mode,
        load=load,
        requests=len(records),
        errors=len(errors),
        duration_s=duration,
        output_tokens_per_s=tokens / duration,
        requests_per_s=len(ok) / duration,
        ttft_ms=pcts(ttft),
        itl_ms=pcts(itl),
        e2e_ms=pcts(e2e),
        tokens_per_message=statistics.fmean(r.tokens / r.messages for r in ok if r.messages)
        if ok
        else 0.0,
        first_error=errors[0] if errors else None,
    )


TARGETS = ("switchyard", "worker", "worker-stream", "vllm-grpc", "smg", "openai")


def make_target(kind: str, address: str, model: str, connections: int = 1) -> Target:
    """A target by name: `address` is host:port for gRPC, a base URL for HTTP."""
    if kind == "switchyard":
        return SwitchyardTarget(address, model, connections=connections)
    if kind == "worker":
        return WorkerTarget(address)
    if kind == "worker-stream":
        return WorkerStreamTarget(address)
    if kind == "vllm-grpc":
        return VllmGrpcTarget(address)
    if kind == "smg":
        return SmgGenerateTarget(address, model)
    if kind == "openai":
        return OpenAIHttpTarget(address, model)
    raise ValueError(f"unknown target {kind!r}; expected one of {', '.join(TARGETS)}")
