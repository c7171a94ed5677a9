"""One generation, end to end: admit, run its worker attempts, and finish with its Final.

`run_generation` takes a `PreparedRequest` (control.request.prepare) and is an async
generator of public `GenerateResponse` messages: the chunks (control.request.attempts,
control.request.output), then the Final with its timing, or a beam search's answers
(control.request.beams). It says when its last message is out (`Progress.over`), so a
cancel after it is not counted as a cancelled request. Callers must close it
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
from collections.abc import AsyncGenerator
from typing import Protocol

from switchyard.v1 import common_pb2, generation_pb2

from control.fleet.models import ModelEntry
from control.request.attempts import Attempts
from control.request.beams import beam_responses
from control.request.direct import ChunkSink
from control.request.output import PROMPT_CONTEXT_TOKENS, OutputState
from control.request.prepare import PreparedRequest
from control.tracing import Context, tracer
from switchyard_common.deadlines import budget as time_budget

FinishReason = common_pb2.FinishReason
# FINISH_REASON_STOP -> "stop": the label of switchyard_request_success, as vLLM's.
_REASON_LABELS = {
    v.number: v.name.removeprefix("FINISH_REASON_").lower()
    for v in common_pb2.DESCRIPTOR.enum_types_by_name["FinishReason"].values
}


class TokenBudget(Protocol):
    """A caller's token rate (control.api.auth.Caller)."""

    def take_tokens(self, n: int) -> None: ...

    def give_back_tokens(self, n: int) -> None: ...


class Progress:
    """Whether a request's last message has been handed out."""

    __slots__ = ("over",)

    def __init__(self) -> None:
        self.over = False


async def run_generation(
    prepared: PreparedRequest,
    progress: Progress | None = None,
    trace: Context | None = None,
    budget: TokenBudget | None = None,
    sink: ChunkSink | None = None,
) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    """`sink`: the public stream, when chunks may be written to it directly
    (control.request.direct). `budget`, when given, is charged the prompt plus
    max_tokens before admission (raising Overloaded beyond its rate) and gets back what
    was not generated. `progress.over` is set as the last message goes out."""
    entry, params = prepared.entry, prepared.params
    prompt_tokens = len(prepared.prompt_ids)
    most = prepared.most_tokens
    charged = 0
    if budget is not None:
        charged = prompt_tokens + most
        budget.take_tokens(charged)
    if progress is None:
        progress = Progress()

    final = generation_pb2.Final(
        request_id=params.request_id, engine=entry.info.label, adapter=params.adapter
    )
    final.usage.prompt_tokens = prompt_tokens
    received_at = prepared.received_at
    deadline = prepared.deadline
    wait = None if deadline is None else time_budget(deadline - time.monotonic())
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
        progress.over = True
        yield generation_pb2.GenerateResponse(final=final)
        return
    except BaseException as e:  # overloaded, or the caller went away while queued
        span.set_attribute("switchyard.outcome", type(e).__name__)
        if budget is not None:
            budget.give_back_tokens(charged)
        raise
    finally:
        span.end()
    run: Attempts | None = None
    try:
        entry.metrics.prompt_tokens.inc(prompt_tokens)
        output = OutputState(
            entry.tokenizer,
            params,
            prepared.prompt_ids,
            entry.info.eos_token_ids,
            final,
            entry.metrics.generation_tokens.inc,
        )
        run = Attempts(prepared, output, trace, sink)
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
                prepared.prompt_ids[-PROMPT_CONTEXT_TOKENS:],
                params.skip_special_tokens,
                final,
                run.beams,
            )
            final.usage.completion_tokens = beams[-1].final.total_usage.completion_tokens
            entry.metrics.generation_tokens.inc(final.usage.completion_tokens)
            _record_final(entry, final)
            for i, msg in enumerate(beams, 1):
                progress.over = i == len(beams)
                yield msg
            return
        _record_final(entry, final)
        progress.over = True
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
