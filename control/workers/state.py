"""What the control plane knows of one worker now, in one place.

Routing reads a `WorkerState` (it is the routing `Candidate`); the calls in flight
(control.workers.call), the health tasks (control.workers.health) and the fleet change
it through its methods, so each counter's invariant is kept beside the counter. It holds
no connection: `WorkerClient` (control.workers.client) is a `WorkerState` with a channel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from switchyard.v1 import common_pb2

from control.workers.circuit import CircuitBreaker


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a worker's engine can do through the API (switchyard.v1.Capabilities)."""

    max_logprobs: int = 0
    prompt_logprobs: bool = False
    structured_output: frozenset[str] = frozenset()
    max_n: int = 1
    beam_search: bool = False
    lora: bool = False
    max_loras: int = 0
    max_lora_rank: int = 0
    max_beam_width: int = 0
    resume_tokens: bool = False  # takes resume_token_ids apart from the prompt
    resumable_constraints: frozenset[str] = frozenset()  # kinds it continues mid-output
    stream_interval: bool = False  # sends its chunks at the request's stream_interval

    @classmethod
    def of(cls, msg: Any) -> Capabilities:
        return cls(
            max_logprobs=msg.max_logprobs,
            prompt_logprobs=msg.prompt_logprobs,
            structured_output=frozenset(msg.structured_output),
            max_n=max(1, msg.max_n),
            beam_search=msg.beam_search,
            lora=msg.lora,
            max_loras=msg.max_loras,
            max_lora_rank=msg.max_lora_rank,
            max_beam_width=msg.max_beam_width if msg.beam_search else 0,
            resume_tokens=msg.resume_tokens,
            resumable_constraints=frozenset(msg.resumable_constraints),
            stream_interval=msg.stream_interval,
        )

    def to_proto(self) -> common_pb2.Capabilities:
        return common_pb2.Capabilities(
            max_logprobs=self.max_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            structured_output=sorted(self.structured_output),
            max_n=self.max_n,
            beam_search=self.beam_search,
            lora=self.lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_beam_width=self.max_beam_width,
            resume_tokens=self.resume_tokens,
            resumable_constraints=sorted(self.resumable_constraints),
            stream_interval=self.stream_interval,
        )


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    engine: str
    engine_version: str
    model: str
    max_context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_block_size: int
    generate_stream: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str = ""
    weight_dtype: str = ""
    kv_cache_dtype: str = ""
    kv_blocks_total: int = 0
    gpu_memory_total_bytes: int = 0
    capabilities: Capabilities | None = None  # None: a worker that does not declare them
    kv_events: bool = False  # serves SubscribeKvEvents

    @property
    def label(self) -> str:
        return f"{self.engine} {self.engine_version}"


@dataclass(slots=True)
class Load:
    """A worker's own report of its engine's load (StreamLoad)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    updated: float = 0.0  # time.monotonic() of the report
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    gpu_memory_used_bytes: int = 0
    generation_tokens_per_s: float = 0.0  # the engine's, over the worker's last seconds


class KvSink(Protocol):
    """Where a worker's KV-cache events go (control.routing.kv_index.KvIndex): by the
    worker's address, and the engine's own block hashes."""

    def stored(
        self,
        worker: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        salt: str = "",
    ) -> bool: ...

    def removed(self, worker: str, engine_hashes: Iterable[int]) -> None: ...

    def cleared(self, worker: str) -> None: ...


class InFlight(Protocol):
    """A generation in flight on the worker (control.workers.call.WorkerCall)."""

    adapter: str  # the LoRA adapter it uses ("" for none)

    def eject(self) -> None: ...


class WorkerState:
    """One worker as the control plane sees it."""

    def __init__(self, address: str, failure_threshold: int = 3) -> None:
        self.address = address
        self.info: WorkerInfo | None = None  # its GetInfo, once read
        self.serving = False  # its health says SERVING (set_serving)
        self.draining = False  # no new requests: it is being drained or unloaded
        self.leaving = False  # gone from DNS; removed once drained
        # Calls in flight from this process (begin_call / end_call keep these three).
        self.calls: set[InFlight] = set()
        self.in_flight_tokens = 0  # their prompt plus output tokens
        self.prefill_tokens = 0  # prompt tokens of the calls with no message back yet
        self.in_flight_at_report = 0  # in_flight when `load` was reported
        self.load = Load()
        self.adapters: set[str] = set()  # the LoRA adapters it holds, as far as we know
        self.breaker = CircuitBreaker(failure_threshold=failure_threshold)
        self.last_canary_ms: float | None = None
        self._kv_sink: KvSink | None = None
        self.kv_sink_set = asyncio.Event()  # its model has given it a sink
        # The current KV-events subscription's snapshot (what the engine holds) is in the
        # sink, to the batch that ends it; cleared when the stream ends.
        self.kv_synced = asyncio.Event()

    # -- read by routing, the API and the metrics

    @property
    def in_flight(self) -> int:
        """Calls in flight on it from this process."""
        return len(self.calls)

    @property
    def healthy(self) -> bool:
        """Eligible for new requests: SERVING, known, circuit closed, not draining."""
        return (
            self.serving
            and self.info is not None
            and not self.draining
            and self.breaker.allows_traffic()
        )

    @property
    def running(self) -> int:
        return self.load.running

    @property
    def waiting(self) -> int:
        return self.load.waiting

    def state(self, peek: bool = False) -> str:
        """closed, open, half_open, draining or not_serving; `peek` reads it without
        changing the breaker (for the metrics thread)."""
        if self.draining:
            return "draining"
        if not self.serving:
            return "not_serving"
        return (self.breaker.peek() if peek else self.breaker.state).value

    @property
    def kv_sink(self) -> KvSink | None:
        """Where its KV-cache events go: its model's index, set by the model where routing
        reads the events (None: nowhere, and they are not followed)."""
        return self._kv_sink

    @kv_sink.setter
    def kv_sink(self, sink: KvSink | None) -> None:
        self._kv_sink = sink
        if sink is None:
            self.kv_sink_set.clear()
        else:
            self.kv_sink_set.set()

    # -- written by the calls in flight

    def begin_call(self, call: InFlight, cost_tokens: int, prompt_tokens: int) -> None:
        """A call starts: counted in flight, its prompt as prefill until `prefilled`."""
        self.calls.add(call)
        self.in_flight_tokens += cost_tokens
        self.prefill_tokens += prompt_tokens

    def prefilled(self, prompt_tokens: int) -> None:
        """A call's first message is back: its prompt is no longer waiting."""
        self.prefill_tokens -= prompt_tokens

    def end_call(self, call: InFlight, cost_tokens: int, prompt_tokens_left: int) -> None:
        """A call is over (once; a second time changes nothing)."""
        if call not in self.calls:
            return
        self.calls.discard(call)
        self.in_flight_tokens -= cost_tokens
        self.prefill_tokens -= prompt_tokens_left

    def eject_calls(self) -> int:
        """Every call in flight fails with EJECTED, free to move; how many there were."""
        calls = list(self.calls)
        for call in calls:
            call.eject()
        return len(calls)

    # -- written by the health tasks and the fleet

    def set_serving(self, serving: bool) -> None:
        if not serving:
            self.adapters.clear()  # a worker that comes back holds none
        self.serving = serving

    def report_load(self, load: Load) -> None:
        self.in_flight_at_report = self.in_flight
        self.load = load
