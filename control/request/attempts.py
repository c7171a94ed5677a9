"""The worker attempts of one admitted request: route, call, fail over.

`Attempts.stream()` yields the request's public chunks. Each attempt routes to a worker
not tried yet, sends the request (resumed after the tokens so far when an earlier worker
failed mid-stream, control.request.resume) and hands each worker chunk to the request's
`OutputState`, which makes the public chunk. A worker failure arrives as
`WorkerCallFailed`; the failover policy (control.request.failover) says whether another
worker continues, the stream ends (TIME_LIMIT, ERROR) or the request fails, and what the
client then hears. What stays here is transport: routing, the worker call, its spans,
inter-token latency and the failover metrics.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator

import structlog
from opentelemetry.trace import StatusCode
from switchyard.v1 import common_pb2, generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.errors import NoHealthyWorker
from control.request.direct import ChunkSink, DirectChunks
from control.request.failover import DEFAULT_FAILOVER, Next, client_error, no_worker_left
from control.request.output import OutputState
from control.request.prepare import PreparedRequest
from control.request.resume import can_resume, resume_request
from control.routing import RouteRequest
from control.tracing import Context, SpanKind, headers_of, tracer
from control.workers.call import FailureKind, WorkerCallFailed
from control.workers.client import WorkerClient
from control.workers.stream import StreamCall
from switchyard_common.deadlines import budget

log = structlog.get_logger(__name__)

FinishReason = common_pb2.FinishReason


def build_worker_request(
    prepared: PreparedRequest, max_tokens: int, min_tokens: int
) -> worker_pb2.GenerateRequest:
    """The worker's request for the prompt (a resume adds the tokens so far to it)."""
    params = prepared.params
    req = worker_pb2.GenerateRequest(
        request_id=params.request_id,
        prompt_token_ids=prepared.prompt_ids,
        sampling=params.sampling.to_proto(),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        priority=params.priority,
    )
    if params.logprobs is not None:
        req.logprobs = params.logprobs
    if params.constraint is not None:
        req.constraint.CopyFrom(params.constraint.to_proto())
    if params.prompt_logprobs is not None:
        req.prompt_logprobs = params.prompt_logprobs
    if params.adapter:
        req.adapter = params.adapter
    if params.beam_width > 1:
        req.beam_width = params.beam_width
    return req


class _Over(Exception):
    """An attempt ended the request (a Final, a stop string, the time limit)."""


class Attempts:
    """The worker attempts of one request; fills `output.final` as it goes."""

    def __init__(
        self,
        prepared: PreparedRequest,
        output: OutputState,
        trace: Context | None = None,
        sink: ChunkSink | None = None,
    ) -> None:
        self.prepared = prepared
        self.sink = sink  # where chunks may go directly (control.request.direct)
        self.entry = prepared.entry
        self.params = prepared.params
        self.output = output
        self.final = output.final
        self.trace = trace
        self.beams: list[worker_pb2.Beam] = []  # beam search: the worker's, at the end
        self.attempts = 0
        self.engine_errors = 0
        self.failover = DEFAULT_FAILOVER
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.worker_queue_ms = 0.0
        self.interrupted_by: WorkerCallFailed | None = None  # the failure a resume follows
        self.refused: WorkerCallFailed | None = None  # a worker that would not resume it

    def generated_total(self) -> int:
        """Tokens generated for the caller: the stream's, or every beam's."""
        if self.beams:
            return sum(len(b.token_ids) for b in self.beams)
        return len(self.output.generated)

    async def stream(self) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        tried: list[WorkerClient] = []
        last_failure: WorkerCallFailed | None = None
        generated = self.output.generated
        while True:
            remaining_tokens = self.prepared.max_tokens - len(generated)
            if remaining_tokens <= 0:  # the worker died after its last token
                self.final.finish_reason = FinishReason.FINISH_REASON_LENGTH
                break
            if tried and self.output.ended_by_last_token():  # it died after EOS or a stop id
                break
            worker = self._route(remaining_tokens, tried, last_failure)
            structlog.contextvars.bind_contextvars(worker=worker.address)
            self.final.worker = worker.address
            try:
                attempt = self._attempt(worker, remaining_tokens)
                async with contextlib.aclosing(attempt):
                    async for msg in attempt:
                        yield msg
            except _Over:
                break
            except WorkerCallFailed as failure:  # another worker continues
                last_failure = failure
                tried.append(worker)
        tail = self.output.flush()
        if tail is not None:
            yield tail

    def _route(
        self, remaining_tokens: int, tried: list[WorkerClient], last: WorkerCallFailed | None
    ) -> WorkerClient:
        """The next worker, or the client's error when none is left."""
        route = RouteRequest(
            prompt_ids=self.prepared.prompt_ids,
            max_tokens=remaining_tokens * self.params.beam_width,  # every beam's
            kv_block_size=self.entry.info.kv_block_size or 16,
            adapter=self.params.adapter,
        )
        span = tracer.start_span(
            "switchyard.route",
            context=self.trace,
            attributes={"switchyard.policy": self.entry.policy.name},
        )
        # A constrained stream resumes only where its constraint goes on holding.
        generated = self.output.generated
        constrained = bool(generated) and self.params.constraint is not None
        only = self._can_resume if constrained else None
        try:
            worker = self.entry.pick_worker(route, tried, self.params.adapter, only)
            span.set_attribute("switchyard.worker", worker.address)
            return worker
        except NoHealthyWorker as e:
            span.set_attribute("switchyard.outcome", "no_healthy_worker")
            others = constrained and any(w.healthy and w not in tried for w in self.entry.workers)
            error = no_worker_left(
                e,
                self.params,
                self.entry.name,
                len(generated),
                last,
                self.interrupted_by,
                self.refused,
                others,
            )
            if error is e:
                raise
            raise error from e
        finally:
            span.end()

    def _can_resume(self, worker: WorkerClient) -> bool:
        return can_resume(worker, self.params)

    def _remaining_s(self) -> float | None:
        deadline = self.prepared.deadline
        return None if deadline is None else budget(deadline - time.monotonic())

    async def _attempt(
        self, worker: WorkerClient, remaining_tokens: int
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """Public chunks from one worker. Raises `_Over` when the request is over (its
        Final filled in), `WorkerCallFailed` when another worker should continue, and the
        client's error when the request fails."""
        p = self.params
        output = self.output
        generated = output.generated
        prompt_ids = self.prepared.prompt_ids
        wreq = build_worker_request(
            self.prepared, remaining_tokens, max(0, p.min_tokens - len(generated))
        )
        resumed = bool(generated)
        if resumed:  # continue after the tokens so far (control.request.resume)
            resume_request(wreq, worker, list(prompt_ids), generated, p)
        self.attempts += 1
        timeout = self._remaining_s()
        if timeout is not None and timeout <= 0:
            self.final.finish_reason = FinishReason.FINISH_REASON_TIME_LIMIT
            raise _Over
        metrics = self.entry.metrics
        span = tracer.start_span(
            "switchyard.worker_attempt",
            context=self.trace,
            kind=SpanKind.CLIENT,
            attributes={
                "switchyard.worker": worker.address,
                "switchyard.attempt": self.attempts,
                "switchyard.resumed_after_tokens": len(generated),
            },
        )
        headers = headers_of(span)
        wreq.traceparent = headers.get("traceparent", "")
        wreq.tracestate = headers.get("tracestate", "")
        generated_before = len(generated)
        noted = False  # in final.resumed_after_tokens
        context_len = len(prompt_ids) + len(generated)
        cost = context_len + remaining_tokens * p.beam_width
        interval = self.prepared.stream_interval
        if interval > 1:
            wreq.stream_interval = interval
        held: worker_pb2.Chunk | None = None  # tokens kept back for the stream's cadence
        call = worker.generate(wreq, timeout, cost_tokens=cost, prompt_tokens=context_len)
        direct: DirectChunks | None = None
        if self.sink is not None and interval <= 1 and not p.stop and p.beam_width <= 1:
            direct = DirectChunks(output, self.sink, metrics.itl, self)
        try:
            async with call as events:
                source = call.source
                direct_to = source if isinstance(source, StreamCall) else None
                async for resp in events:
                    if resumed and not noted:  # the new worker answers: the stream goes on
                        self.final.resumed_after_tokens.append(generated_before)
                        noted = True
                    if resp.HasField("final"):
                        if held is not None:
                            yield output.push(held)
                            held = None
                        self._take_final(resp.final)  # after a stop string: still STOP
                        raise _Over
                    wchunk = resp.chunk
                    now = time.perf_counter()
                    if self.first_token_at is None:
                        self.first_token_at = now
                    elif n := len(wchunk.token_ids):
                        metrics.itl.observe((now - self.last_token_at) / n)
                    self.last_token_at = now
                    if interval > 1:
                        # The first token at once, then at least `interval` a chunk (a
                        # worker that keeps the cadence itself sends them so already).
                        if held is not None:
                            held.MergeFrom(wchunk)
                            wchunk = held
                        if generated and len(wchunk.token_ids) < interval:
                            held = wchunk
                            continue
                        held = None
                    yield output.push(wchunk)
                    if output.stopped:
                        call.cancel()  # the worker aborts the engine request
                        raise _Over
                    if direct is not None and direct_to is not None:
                        direct_to.direct = direct  # the next chunks, where they arrive
        except WorkerCallFailed as failure:
            if held is not None:  # the tokens it did generate stand; another continues
                yield output.push(held)
                held = None
                if output.stopped:
                    raise _Over from failure
            span.set_status(StatusCode.ERROR, f"{failure.kind.value}: {failure.message}")
            self._fail_over(failure, worker, resumed and len(generated) == generated_before)
            if failure is not self.refused:
                span.add_event("failover", {"switchyard.kind": failure.kind.value})
            raise
        finally:
            output.count()  # before the client can see the end
            span.set_attribute("switchyard.tokens", len(generated) - generated_before)
            span.end()

    def _take_final(self, wf: worker_pb2.Final) -> None:
        self.output.take_final(wf)
        self.worker_queue_ms += wf.queue_ms
        if wf.beams:
            self.beams = list(wf.beams)
            self.first_token_at = time.perf_counter()  # the answer's tokens, all at once

    def _fail_over(self, failure: WorkerCallFailed, worker: WorkerClient, refused: bool) -> None:
        """Returns when another worker should continue after `failure`; raises `_Over`
        when the stream ends here, the client's error when the request fails."""
        generated = self.output.generated
        p = self.params
        if refused and failure.kind is FailureKind.REJECTED:
            # It would not continue this stream (before any new token); another worker may.
            self.refused = failure
            log.warning(
                "worker refused to resume a stream",
                worker=worker.address,
                error=failure.message,
                tokens_so_far=len(generated),
                request_id=p.request_id,
            )
            return
        step = self.failover.next_step(failure, self.engine_errors)
        if step is Next.TIME_LIMIT:
            self.final.finish_reason = FinishReason.FINISH_REASON_TIME_LIMIT
            raise _Over from failure
        if step is Next.FAIL:
            if not generated:
                raise client_error(failure, p) from failure
            self.final.finish_reason = FinishReason.FINISH_REASON_ERROR
            self.final.error_message = str(failure)
            raise _Over from failure
        if failure.kind is FailureKind.ENGINE:
            self.engine_errors += 1
        if generated:
            self.interrupted_by = failure
        metrics = self.entry.metrics
        metrics.failover(failure.kind.value, resumed=bool(generated))
        if failure.kind is FailureKind.EJECTED:  # the hung worker's request is aborted
            metrics.cancelled("failover")
        log.warning(
            "worker failed; failing over",
            worker=worker.address,
            kind=failure.kind.value,
            error=failure.message,
            tokens_so_far=len(generated),
            request_id=p.request_id,
        )
