"""One generation, end to end: tokenize, admit, route, stream from a worker, detokenize,
match stop strings, fail over, and finish with exactly one `Final`.

`run_generation` is an async generator of public `GenerateResponse` messages; both
`Generate` (streamed) and `Complete` (aggregated) consume it. Callers must close it
(`contextlib.aclosing`) so that an abandoned stream cancels the worker call and frees its
admission slot at once.

Failover: a worker that fails before the first token is replaced invisibly. One that
fails later is replaced too, and the new worker continues from the prompt plus the tokens
generated so far, so the client sees one stream. With no worker left, the stream ends
with UNAVAILABLE and a message, never a hang.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

import grpc
import structlog
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from opentelemetry.trace import StatusCode
from switchyard.v1 import common_pb2, generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.errors import (
    AdapterNotFound,
    FieldViolation,
    InvalidArgument,
    NoHealthyWorker,
    NotResumable,
    Overloaded,
    SwitchyardError,
    WorkerFailed,
)
from control.fleet.models import ModelEntry
from control.request.beams import beam_responses
from control.request.capabilities import check_adapter, check_capabilities
from control.request.failover import DEFAULT_POLICY, Next
from control.request.prompts import prompt_ids_of
from control.request.resume import (
    can_resume,
    not_resumable_anywhere,
    refused_resume,
    resume_request,
    said,
)
from control.routing import RouteRequest
from control.text.params import GenerationParams
from control.text.stops import StopMatcher
from control.tracing import Context, SpanKind, headers_of, tracer
from control.workers.call import FailureKind, WorkerCallFailed
from control.workers.client import WorkerClient
from switchyard_common.deadlines import budget

log = structlog.get_logger(__name__)

# The generated-token counter is given its tokens this many at a time, and the rest when
# the attempt ends: once per chunk it was 5.5% of a busy control plane's time on the H200
# (docs/profiles.md), for a series read at scrape time.
COUNT_EVERY_TOKENS = 64

FinishReason = common_pb2.FinishReason
# FINISH_REASON_STOP -> "stop": the label of switchyard_request_success, as vLLM's.
_REASON_LABELS = {
    v.number: v.name.removeprefix("FINISH_REASON_").lower()
    for v in common_pb2.DESCRIPTOR.enum_types_by_name["FinishReason"].values
}
PROMPT_CONTEXT_TOKENS = 5
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


class TokenBudget(Protocol):
    """A caller's token rate (control.api.auth.Caller)."""

    def take_tokens(self, n: int) -> None: ...

    def give_back_tokens(self, n: int) -> None: ...


def build_worker_request(
    params: GenerationParams, prompt_ids: Sequence[int], max_tokens: int, min_tokens: int
) -> worker_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams()
    s = params.sampling
    for name in _SAMPLING_FIELDS:
        value = getattr(s, name)
        if value is not None:
            setattr(sampling, name, value)
    req = worker_pb2.GenerateRequest(
        request_id=params.request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
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


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return budget(deadline - time.monotonic())


async def run_generation(
    entry: ModelEntry,
    params: GenerationParams,
    received_at: float,
    time_remaining: float | None,
    trace: Context | None = None,
    budget: TokenBudget | None = None,
) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    """`budget`, when given, is charged the prompt plus max_tokens before admission
    (raising Overloaded beyond its rate) and gets back what was not generated."""
    deadline = None if time_remaining is None else time.monotonic() + time_remaining
    check_capabilities(entry, params)
    await check_adapter(entry, params)
    prompt_ids = await prompt_ids_of(entry, params)
    max_tokens = entry.limits.bind(params, prompt_ids)
    most = max_tokens * params.beam_width  # the tokens it may generate, all beams
    charged = 0
    if budget is not None:
        charged = len(prompt_ids) + most
        budget.take_tokens(charged)

    final = generation_pb2.Final(
        request_id=params.request_id, engine=entry.info.label, adapter=params.adapter
    )
    final.usage.prompt_tokens = len(prompt_ids)
    wait = _remaining(deadline)
    span = tracer.start_span(
        "switchyard.admission",
        context=trace,
        attributes={"switchyard.queue_depth": entry.admission.queued},
    )
    try:
        if wait is not None and wait <= 0:
            raise TimeoutError
        await entry.admission.acquire(params.priority, wait)
    except TimeoutError:
        span.set_attribute("switchyard.outcome", "time_limit")
        final.finish_reason = FinishReason.FINISH_REASON_TIME_LIMIT
        final.timing.queue_ms = (time.perf_counter() - received_at) * 1000.0
        final.timing.total_ms = final.timing.queue_ms
        _record_final(entry, final)
        if budget is not None:
            budget.give_back_tokens(most)
        yield generation_pb2.GenerateResponse(final=final)
        return
    except BaseException as e:  # overloaded, or the caller went away while queued
        span.set_attribute("switchyard.outcome", type(e).__name__)
        if budget is not None:
            budget.give_back_tokens(charged)
        raise
    finally:
        span.end()
    run: _Run | None = None
    try:
        entry.metrics.prompt_tokens.inc(len(prompt_ids))
        run = _Run(entry, params, prompt_ids, max_tokens, deadline, final, trace)
        final.timing.queue_ms = (time.perf_counter() - received_at) * 1000.0
        async with contextlib.aclosing(run.stream()) as stream:
            async for msg in stream:
                yield msg
        final.timing.queue_ms += run.worker_queue_ms
        if run.first_token_at is not None:
            final.timing.time_to_first_token_ms = (run.first_token_at - received_at) * 1000.0
        final.timing.total_ms = (time.perf_counter() - received_at) * 1000.0
        if run.beams:
            beams = beam_responses(
                entry.tokenizer,
                prompt_ids[-PROMPT_CONTEXT_TOKENS:],
                params.skip_special_tokens,
                final,
                run.beams,
            )
            final.usage.completion_tokens = beams[-1].final.total_usage.completion_tokens
            entry.metrics.generation_tokens.inc(final.usage.completion_tokens)
            _record_final(entry, final)
            for msg in beams:
                yield msg
            return
        _record_final(entry, final)
        yield generation_pb2.GenerateResponse(final=final)
    finally:
        entry.admission.release()
        if budget is not None:  # what it did not generate, however it ended
            budget.give_back_tokens(most - (run.generated_total() if run else 0))


def _record_final(entry: ModelEntry, final: generation_pb2.Final) -> None:
    """The metrics of a generation that ended with a Final."""
    m = entry.metrics
    timing = final.timing
    m.finished(_REASON_LABELS.get(final.finish_reason, "unspecified"))
    m.queue_time.observe(timing.queue_ms / 1000.0)
    m.e2e.observe(timing.total_ms / 1000.0)
    if final.usage.completion_tokens:
        m.ttft.observe(timing.time_to_first_token_ms / 1000.0)
    if final.usage.cached_prompt_tokens:
        m.cached_prompt_tokens.inc(final.usage.cached_prompt_tokens)
    if final.finish_reason == FinishReason.FINISH_REASON_TIME_LIMIT:
        m.cancelled("deadline")
    elif final.stop_string:
        m.cancelled("stop_string")


class _Run:
    """The worker attempts of one admitted request; fills `final` as it goes."""

    def __init__(
        self,
        entry: ModelEntry,
        params: GenerationParams,
        prompt_ids: list[int],
        max_tokens: int,
        deadline: float | None,
        final: generation_pb2.Final,
        trace: Context | None = None,
    ) -> None:
        self.entry = entry
        self.trace = trace
        self.params = params
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.deadline = deadline
        self.final = final
        self.generated: list[int] = []
        self.beams: list[worker_pb2.Beam] = []  # beam search: the worker's, at the end
        self.attempts = 0
        self.engine_errors = 0
        self.failover = DEFAULT_POLICY
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.worker_queue_ms = 0.0
        self.uncounted = 0  # generated tokens not yet given to the counter
        self.prompt_logprobs_sent = False
        self.interrupted_by: WorkerCallFailed | None = None  # the failure a resume follows
        self.refused: WorkerCallFailed | None = None  # a worker that would not resume it
        self.detok = entry.tokenizer.detokenizer(
            prompt_ids[-PROMPT_CONTEXT_TOKENS:], params.skip_special_tokens
        )
        self.matcher = (
            StopMatcher(params.stop, include_stop=params.include_stop) if params.stop else None
        )

    async def stream(self) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        tried: list[WorkerClient] = []
        last_failure: WorkerCallFailed | None = None
        while True:
            remaining_tokens = self.max_tokens - len(self.generated)
            if remaining_tokens <= 0:  # the worker died after its last token
                self.final.finish_reason = FinishReason.FINISH_REASON_LENGTH
                break
            if tried and self._ended_by_last_token():  # it died after an EOS or stop token
                break
            route = RouteRequest(
                prompt_ids=self.prompt_ids,
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
            constrained = bool(self.generated) and self.params.constraint is not None
            only = self._can_resume if constrained else None
            try:
                worker = self.entry.pick_worker(route, tried, self.params.adapter, only)
                span.set_attribute("switchyard.worker", worker.address)
            except NoHealthyWorker as e:
                span.set_attribute("switchyard.outcome", "no_healthy_worker")
                if self.generated:
                    n = len(self.generated)
                    cause = self.interrupted_by or last_failure
                    if self.refused is not None:  # the workers that could, would not
                        raise refused_resume(n, self.refused, cause) from e
                    if constrained and any(
                        w.healthy and w not in tried for w in self.entry.workers
                    ):
                        raise not_resumable_anywhere(self.entry.name, self.params, n, cause) from e
                    raise NotResumable(n, said(cause), f"{e}") from e
                # Nobody left to try: the client hears what went wrong, not just that.
                if last_failure is not None and last_failure.kind is FailureKind.OVERLOADED:
                    raise Overloaded(
                        f"model {self.entry.name!r}: every worker is full ({e})",
                        last_failure.retry_after_s or 1.0,
                    ) from e
                if last_failure is not None and last_failure.kind is FailureKind.ENGINE:
                    raise WorkerFailed(last_failure.worker, f"{last_failure.message}; {e}") from e
                raise
            finally:
                span.end()
            structlog.contextvars.bind_contextvars(worker=worker.address)
            self.final.worker = worker.address
            failed: WorkerCallFailed | None = None
            async with contextlib.aclosing(self._attempt(worker, remaining_tokens)) as attempt:
                async for msg in attempt:
                    if isinstance(msg, WorkerCallFailed):  # another worker continues
                        failed = msg
                        break
                    if msg.HasField("final"):
                        break
                    yield msg
            if failed is None:
                break
            last_failure = failed
            tried.append(worker)
        if not self.final.stop_string:
            tail = self._match(self.detok.flush(), final_piece=True)
            if tail:
                yield generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(text=tail))
        self.final.usage.completion_tokens = len(self.generated)
        if self.final.stop_string:
            self.final.finish_reason = FinishReason.FINISH_REASON_STOP

    def _can_resume(self, worker: WorkerClient) -> bool:
        return can_resume(worker, self.params)

    def generated_total(self) -> int:
        """Tokens generated for the caller: the stream's, or every beam's."""
        return sum(len(b.token_ids) for b in self.beams) if self.beams else len(self.generated)

    def _ended_by_last_token(self) -> bool:
        """Whether the tokens so far already end the request (the worker that made them
        failed before its final): resuming would generate past the end."""
        if not self.generated:
            return False
        last = self.generated[-1]
        if last in self.params.stop_token_ids:
            self.final.stop_token_id = last
        elif not self.params.ignore_eos and last in self.entry.info.eos_token_ids:
            self.final.eos_token_id = last
        else:
            return False
        self.final.finish_reason = FinishReason.FINISH_REASON_STOP
        return True

    def _match(self, text: str, final_piece: bool = False) -> str:
        if self.matcher is None or self.final.stop_string:
            return text
        r = self.matcher.push(text)
        if r.stop is not None:
            self.final.stop_string = r.stop
            return r.text
        return r.text + (self.matcher.flush() if final_piece else "")

    async def _attempt(
        self, worker: WorkerClient, remaining_tokens: int
    ) -> AsyncGenerator[generation_pb2.GenerateResponse | WorkerCallFailed, None]:
        """Chunks from one worker; then a message with `final` set when the request is
        over (the Final itself is filled in self.final), or the failure when another
        worker should continue."""
        p = self.params
        context = self.prompt_ids + self.generated
        wreq = build_worker_request(
            p, self.prompt_ids, remaining_tokens, max(0, p.min_tokens - len(self.generated))
        )
        resumed = bool(self.generated)
        if resumed:  # continue after the tokens so far (control.request.resume)
            resume_request(wreq, worker, self.prompt_ids, self.generated, p)
        self.attempts += 1
        timeout = _remaining(self.deadline)
        if timeout is not None and timeout <= 0:
            self.final.finish_reason = FinishReason.FINISH_REASON_TIME_LIMIT
            yield generation_pb2.GenerateResponse(final=self.final)
            return
        want_logprobs = p.logprobs is not None
        metrics = self.entry.metrics
        span = tracer.start_span(
            "switchyard.worker_attempt",
            context=self.trace,
            kind=SpanKind.CLIENT,
            attributes={
                "switchyard.worker": worker.address,
                "switchyard.attempt": self.attempts,
                "switchyard.resumed_after_tokens": len(self.generated),
            },
        )
        headers = headers_of(span)
        wreq.traceparent = headers.get("traceparent", "")
        wreq.tracestate = headers.get("tracestate", "")
        generated_before = len(self.generated)
        noted = False  # in final.resumed_after_tokens
        cost = len(context) + remaining_tokens * p.beam_width
        call = worker.generate(wreq, timeout, cost_tokens=cost, prompt_tokens=len(context))
        try:
            async with call as events:
                async for resp in events:
                    if resumed and not noted:  # the new worker answers: the stream goes on
                        self.final.resumed_after_tokens.append(generated_before)
                        noted = True
                    if resp.HasField("final"):
                        self._take_final(resp.final)
                        self._count_tokens()  # before the client can see the end
                        yield generation_pb2.GenerateResponse(final=self.final)
                        return
                    wchunk = resp.chunk
                    ids = list(wchunk.token_ids)
                    self.generated.extend(ids)
                    now = time.perf_counter()
                    if self.first_token_at is None:
                        self.first_token_at = now
                    elif ids:
                        metrics.itl.observe((now - self.last_token_at) / len(ids))
                    self.last_token_at = now
                    text = self.detok.push(ids)
                    if self.matcher is not None:
                        text = self._match(text)
                        if self.final.stop_string:
                            ids = self._cut_at_stop(ids)
                    out = generation_pb2.GenerateResponse()
                    chunk = out.chunk  # built in place: no copy of a finished Chunk
                    chunk.text = text
                    chunk.token_ids.extend(ids)
                    if want_logprobs:
                        self._copy_logprobs(chunk.logprobs, wchunk.logprobs[: len(ids)])
                    if wchunk.prompt_logprobs and not self.prompt_logprobs_sent:
                        self._copy_logprobs(chunk.prompt_logprobs, wchunk.prompt_logprobs)
                        self.prompt_logprobs_sent = True
                    self.uncounted += len(ids)
                    if self.uncounted >= COUNT_EVERY_TOKENS:
                        self._count_tokens()
                    yield out
                    if self.final.stop_string:
                        call.cancel()  # the worker aborts the engine request
                        self._count_tokens()
                        yield generation_pb2.GenerateResponse(final=self.final)
                        return
        except WorkerCallFailed as failure:
            self._count_tokens()
            span.set_status(StatusCode.ERROR, f"{failure.kind.value}: {failure.message}")
            if (
                resumed
                and failure.kind is FailureKind.REJECTED
                and len(self.generated) == generated_before
            ):  # it would not continue this stream; another worker may
                self.refused = failure
                log.warning(
                    "worker refused to resume a stream",
                    worker=worker.address,
                    error=failure.message,
                    tokens_so_far=len(self.generated),
                    request_id=p.request_id,
                )
                yield failure
                return
            step = self.failover.next_step(failure, self.engine_errors)
            if step is Next.TIME_LIMIT:
                self.final.finish_reason = FinishReason.FINISH_REASON_TIME_LIMIT
                yield generation_pb2.GenerateResponse(final=self.final)
                return
            if step is Next.FAIL:
                if not self.generated:
                    raise _client_error(failure, p) from failure
                self.final.finish_reason = FinishReason.FINISH_REASON_ERROR
                self.final.error_message = str(failure)
                yield generation_pb2.GenerateResponse(final=self.final)
                return
            if failure.kind is FailureKind.ENGINE:
                self.engine_errors += 1
            if self.generated:
                self.interrupted_by = failure
            span.add_event("failover", {"switchyard.kind": failure.kind.value})
            metrics.failover(failure.kind.value, resumed=bool(self.generated))
            if failure.kind is FailureKind.EJECTED:  # the hung worker's request is aborted
                metrics.cancelled("failover")
            log.warning(
                "worker failed; failing over",
                worker=worker.address,
                kind=failure.kind.value,
                error=failure.message,
                tokens_so_far=len(self.generated),
                request_id=p.request_id,
            )
            yield failure
        finally:
            self._count_tokens()
            span.set_attribute("switchyard.tokens", len(self.generated) - generated_before)
            span.end()

    def _count_tokens(self) -> None:
        if self.uncounted:
            self.entry.metrics.generation_tokens.inc(self.uncounted)
            self.uncounted = 0

    def _cut_at_stop(self, ids: list[int]) -> list[int]:
        """The chunk's ids up to the token that completed the stop string; later ones were
        generated but are not part of the answer (nor of the usage)."""
        if len(ids) <= 1:
            return ids
        base = len(self.generated) - len(ids)
        decode = self.entry.tokenizer.decode
        stop = self.final.stop_string
        for k in range(1, len(ids)):
            if stop in decode(self.generated[: base + k], self.params.skip_special_tokens):
                del self.generated[base + k :]
                return ids[:k]
        return ids

    def _take_final(self, wf: worker_pb2.Final) -> None:
        f = self.final
        f.finish_reason = wf.finish_reason
        # After a resume the worker's prompt includes generated tokens; cap at the prompt.
        f.usage.cached_prompt_tokens = min(wf.usage.cached_prompt_tokens, len(self.prompt_ids))
        self.worker_queue_ms += wf.queue_ms
        if wf.beams:
            self.beams = list(wf.beams)
            self.first_token_at = time.perf_counter()  # the answer's tokens, all at once
        which = wf.WhichOneof("stop_reason")
        if which == "eos_token_id":
            f.eos_token_id = wf.eos_token_id
        elif which == "stop_token_id":
            f.stop_token_id = wf.stop_token_id

    def _copy_logprobs(
        self,
        into: RepeatedCompositeFieldContainer[common_pb2.TokenLogprob],
        src: Sequence[common_pb2.TokenLogprob],
    ) -> None:
        """Into a chunk's (repeated) logprobs, with each alternative's text filled in."""
        into.extend(src)
        decode = self.entry.tokenizer.decode
        for lp in into:
            for top in lp.top:
                top.token = decode([top.token_id], False)


# Worker request fields as the client named them in the public request.
_PUBLIC_FIELDS = {
    "max_tokens": "stopping.max_tokens",
    "min_tokens": "stopping.min_tokens",
    "stop_token_ids": "stopping.stop_token_ids",
    "ignore_eos": "stopping.ignore_eos",
    "logprobs": "output.logprobs",
}


def _public_field(field: str, params: GenerationParams) -> str:
    head, sep, rest = field.partition("[")
    if head == "prompt_token_ids":
        return params.prompt_field
    public = _PUBLIC_FIELDS.get(head)
    return f"{public}{sep}{rest}" if public is not None else field


def _client_error(failure: WorkerCallFailed, params: GenerationParams) -> SwitchyardError:
    """What the client hears of a worker failure that ends its request before any token."""
    if failure.kind is FailureKind.REJECTED and failure.code == grpc.StatusCode.NOT_FOUND:
        # The worker no longer holds the adapter (unloaded since this process looked).
        return AdapterNotFound(params.model, params.adapter, None)
    if failure.kind is FailureKind.REJECTED:
        violations = [
            FieldViolation(
                _public_field(v.field, params), f"{v.description} (worker {failure.worker})"
            )
            for v in failure.violations
        ] or [FieldViolation("request", f"rejected by worker {failure.worker}: {failure.message}")]
        return InvalidArgument(violations)
    if failure.kind is FailureKind.SLOW_READER:
        return Overloaded(f"the stream was read too slowly: {failure.message}", 1.0)
    return WorkerFailed(failure.worker, failure.message)
