"""Chunks written where they arrive: the direct path of a streaming request.

A worker's `GenerateStream` message carries one event for each of its requests, and on
the ordinary path each event wakes its request's task, which hands the chunk up through
the request's generators (attempts, generation, samples, the RPC handler) to the
client's stream: a dozen resumptions per token, per request. When the public stream can
take a message without waiting (`ChunkSink`: the native front's calls can), a request in
the middle of its stream takes the direct path instead: the session's reader hands each
chunk to the request's `DirectChunks`, which makes the public chunk (`OutputState.push`,
the same code) and writes it at once, in the reader's turn. One worker message is then
processed once for all the requests it carries.

Everything else stays on the task: the first token (routing, failover bookkeeping), the
Final, errors and failover, stop strings (the stream must then end), a stream cadence
that holds tokens back, and any chunk that arrives while events wait in the queue or
while the client's stream is full. Each falls back by declining the chunk, which then
queues as before, so the order of messages never changes.

On the native front a request goes further once its chunks are plain (text that is
its tokens' bytes, as byte-level BPE spells them; no logprobs, no stop strings): it is
handed over (`handover`), and the front makes its chunks from the worker's message in
C++ (runtime_cpp/src/front/direct.h), until it hands the request back with the tokens
it wrote (`adopt`), before the first event it leaves to Python.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from switchyard.v1 import generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.request.output import OutputState
from control.text.detokenizer import Vocabulary
from control.workers.stream import Handover, NativeFeed


class ChunkSink(Protocol):
    """A public stream that can take a message without waiting."""

    def ready(self) -> bool:
        """Whether `write_now` would not overfill the stream (and it is still open)."""
        ...

    def write_now(self, message: generation_pb2.GenerateResponse) -> None: ...

    def native(self, vocabulary: Vocabulary) -> tuple[NativeFeed, int, int] | None:
        """Where the native front can write this call's chunks itself, its messages so
        far sent first: (the front, the call's id there, the vocabulary's handle there);
        None when it cannot (yet)."""
        ...


def as_chunk_sink(context: Any) -> ChunkSink | None:
    """`context` when it is a ChunkSink (the native front's calls are), else None. Looked
    up on its class: `isinstance` against a runtime-checkable protocol walks the
    protocol's members on every call, once per request."""
    kind = type(context)
    return context if hasattr(kind, "write_now") and hasattr(kind, "ready") else None


class TokenClock(Protocol):
    """When the request's last token arrived (`Attempts`, which times the others)."""

    last_token_at: float


class DirectChunks:
    """One attempt's chunks on the direct path (a `StreamCall.direct` handler)."""

    __slots__ = ("_clock", "_itl", "_output", "_plain", "_sink")

    def __init__(self, output: OutputState, sink: ChunkSink, itl: Any, clock: TokenClock):
        self._output = output
        self._sink = sink
        self._itl = itl  # the inter-token latency histogram
        self._clock = clock
        self._plain = output.may_be_plain()  # whether `handover` can ever say yes

    def __call__(self, chunk: worker_pb2.Chunk) -> bool:
        """Write `chunk`'s public chunk now; False (and nothing done) when it cannot go."""
        if not self._sink.ready():
            return False
        now = time.perf_counter()
        clock = self._clock
        if n := len(chunk.token_ids):
            self._itl.observe((now - clock.last_token_at) / n)
        clock.last_token_at = now
        self._sink.write_now(self._output.push(chunk))
        return True

    def handover(self) -> Handover | None:
        """What the native front needs to make the next chunks itself, when it can now."""
        if not self._plain:
            return None
        output = self._output
        pending = output.plain_bytes()
        if pending is None:
            return None
        target = self._sink.native(output.vocabulary)
        if target is None:
            return None
        feed, call, vocab = target
        return Handover(
            feed,
            call,
            vocab,
            pending,
            self._clock.last_token_at,
            self._itl.observe,
            output.count_tokens,
        )

    def adopt(self, token_ids: Sequence[int], last_token_at: float) -> None:
        """The tokens the native front wrote while it had the request."""
        if token_ids:
            self._output.adopt(token_ids)
            self._clock.last_token_at = last_token_at
