"""GenerateStream's requests, fed by vLLM's output handler itself: no task per request.

`AsyncLLM.generate()` gives every request its own task, which the output handler wakes
once per engine step; at a thousand streams that is a thousand task switches a step,
and it is what kept the worker below the engine (docs/results/profiles.md). A `StreamedRequest`
adds its request with `AsyncLLM.add_request()` and takes the request's output collector
over: the handler's `put` of each output becomes a plain call that appends the new
tokens to the session's pending message. One engine step then costs one call per
request, and the session's writer wakes once.

The contract is `Generations.serve`'s: exactly one Final (or an error before the first
token) per admitted request; an Abort RPC ends it with CANCELLED, the deadline with
TIME_LIMIT; a caller that gives up hears nothing more, and the engine request is aborted
before the request is released.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

import structlog
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from pyworker.engine_errors import describe, refusal
from pyworker.errors import EngineFailure, StatusError
from pyworker.generations import (
    Generations,
    logprobs,
    prompt_logprobs,
    queue_ms,
)
from pyworker.load import InFlight
from pyworker.request import ParsedGenerate, log_ids
from pyworker.resume_grammar import ResumeGuard

log = structlog.get_logger(__name__)


class EventSink(Protocol):
    """One attempt's messages on its session; none of these waits."""

    def chunk(
        self, token_ids: list[int], logprobs: list[Any] | None, prompt: list[Any] | None = None
    ) -> None:
        """`prompt`: the prompt's logprobs, with the first chunk when they were asked."""

    def final(self, final: Any) -> None: ...

    def error(self, exc: StatusError) -> None: ...


class StreamedRequest:
    """One admitted request of a GenerateStream, from `start()` to its Final."""

    __slots__ = (
        "_abort_sent",
        "_added",
        "_arrived",
        "_cached",
        "_deadline",
        "_first_token_at",
        "_generations",
        "_guard",
        "_held",
        "_last_token",
        "_over",
        "_parsed",
        "_sink",
        "_state",
        "_timer",
        "done",
    )

    def __init__(
        self,
        generations: Generations,
        parsed: ParsedGenerate,
        state: InFlight,
        sink: EventSink,
        arrived: float,
        deadline: float | None,
    ) -> None:
        self._generations = generations
        self._parsed = parsed
        self._state = state
        self._sink = sink
        self._arrived = arrived
        self._deadline = deadline
        self._first_token_at: float | None = None
        self._last_token: int | None = None
        self._cached = 0
        self._guard: ResumeGuard | None = None  # a resumed constrained request's check
        self._over = False  # nothing more goes to the sink
        self._abort_sent = False  # for an Abort RPC that came before the engine knew it
        self._added = False  # add_request() has returned (or failed)
        self._timer: asyncio.TimerHandle | None = None
        # Tokens kept back for the stream's cadence (parsed.stream_interval), and their
        # logprobs (None when not asked).
        self._held: tuple[list[int], list[Any] | None] | None = None
        # Resolved once the request is over in the engine and released.
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def request_id(self) -> str:
        return self._state.request_id

    async def start(self) -> None:
        """Add the request to the engine and take its outputs over. Never raises: a
        refusal goes to the sink as an error."""
        engine = self._generations.engine
        loop = asyncio.get_running_loop()
        if self._over:  # cancelled before this task ran: never reaches the engine
            self._added = True
            self._release()
            return
        if self._deadline is not None:
            when = loop.time() + (self._deadline - time.monotonic())
            self._timer = loop.call_at(when, self._expire)
        try:
            self._guard = await self._generations.check_resume(self._parsed)
            collector = await engine.llm.add_request(
                self._state.request_id,
                engine.make_prompt(self._parsed.engine_prompt),
                self._parsed.sampling_params,
                priority=self._parsed.priority,
                trace_headers=engine.trace_headers(self._parsed.trace_headers),
                lora_request=self._parsed.lora_request,
            )
        except BaseException as exc:
            # Whatever part of the request vLLM took, the abort that follows covers.
            self._added = True
            if not isinstance(exc, Exception):  # cancelled: end quietly, then go
                self._end()
                self._abort_then_release()
                raise
            self._refused(exc)
            return
        self._added = True
        if self._over:  # cancelled, or the deadline fell, while it was being added
            self._abort_then_release()
            return
        try:
            pending = collector.output
            collector.output = None
            collector.put = self._put  # the output handler now calls us
        except Exception as exc:  # a vLLM whose collector works otherwise
            log.error("cannot take the engine's outputs over", exc_info=exc)
            self._fail(f"worker error: {exc!r}")
            return
        if pending is not None:
            self._put(pending)
        if self._state.aborted and not self._over:  # an Abort RPC came while it was added
            self._send_abort()

    def cancel(self) -> None:
        """The caller gave up on this attempt: nothing more is sent; the engine request
        is aborted, then released."""
        if self._over:
            return
        self._end()
        self._abort_then_release()

    # ---- called by vLLM's output handler ----------------------------------------------

    def _put(self, out: Any) -> None:
        if self._over:
            return
        try:
            if isinstance(out, BaseException):
                self._engine_failed(out)
            else:
                self._take(out)
        except Exception as exc:  # a fault of ours: this request still ends
            # This runs inside vLLM's output handler: nothing may escape, or vLLM would
            # fail every request on the engine.
            try:
                log.error(
                    "generate failed unexpectedly",
                    **log_ids(self.request_id, self._parsed),
                    exc_info=exc,
                )
                if not self._over:
                    self._fail(f"worker error: {exc!r}")
                elif not self.done.done():
                    self._abort_then_release()
            except Exception:
                self._release()

    def _take(self, out: Any) -> None:
        state = self._state
        completion = out.outputs[0]
        cached = getattr(out, "num_cached_tokens", None)
        if cached:
            self._cached = int(cached)
        if state.aborted:
            if not out.finished:
                # The Abort RPC came before the engine knew this request.
                self._send_abort()
                return
        else:
            token_ids = list(completion.token_ids)
            if self._guard is not None:
                self._guard.feed(token_ids)
            if token_ids:
                prompt_lps = None
                if self._first_token_at is None:
                    self._first_token_at = time.monotonic()
                    prompt_lps = prompt_logprobs(self._parsed, out)
                lps = None
                if self._parsed.logprobs is not None and completion.logprobs:
                    lps = logprobs(token_ids, completion.logprobs, self._parsed.logprobs)
                interval = self._parsed.stream_interval
                if interval > 1 and state.completion_tokens:  # after the first: a cadence
                    self._hold(token_ids, lps, interval)
                else:
                    self._sink.chunk(token_ids, lps, prompt_lps)
                state.completion_tokens += len(token_ids)
                self._last_token = token_ids[-1]
                self._generations.count_tokens(len(token_ids))
        if out.finished:
            final = self._generations.final_for(
                self._parsed, state, completion, self._last_token, self._guard
            )
            final.usage.prompt_tokens = len(self._parsed.prompt_token_ids)
            final.usage.completion_tokens = state.completion_tokens
            final.usage.cached_prompt_tokens = min(self._cached, len(self._parsed.prompt_token_ids))
            final.queue_ms = queue_ms(getattr(out, "metrics", None))
            if self._first_token_at is not None:
                final.time_to_first_token_ms = (self._first_token_at - self._arrived) * 1000.0
            self._end()
            try:
                self._flush_held()
                self._sink.final(final)
            finally:
                self._release()  # the engine is done with it: nothing to abort

    def _hold(self, token_ids: list[int], lps: list[Any] | None, interval: int) -> None:
        """Keep tokens back until at least `interval` are unsent, then send them all."""
        if self._held is None:
            self._held = (token_ids, lps)
        else:
            held_ids, held_lps = self._held
            held_ids.extend(token_ids)
            if held_lps is not None and lps:
                held_lps.extend(lps)
        if len(self._held[0]) >= interval:
            self._flush_held()

    def _flush_held(self) -> None:
        if self._held is not None:
            ids, lps = self._held
            self._held = None
            self._sink.chunk(ids, lps)

    # ---- endings ----------------------------------------------------------------------

    def _expire(self) -> None:
        """The deadline: the engine request is aborted; the caller hears TIME_LIMIT."""
        self._timer = None
        if self._over:
            return
        log.info("generate deadline expired", **log_ids(self.request_id, self._parsed))
        state = self._state
        final = worker_pb2.Final(
            finish_reason=common_pb2.FINISH_REASON_TIME_LIMIT,
            usage=common_pb2.Usage(
                prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens
            ),
        )
        self._end()
        try:
            self._flush_held()  # generated in time: they go out before TIME_LIMIT
            self._sink.final(final)
        finally:
            self._abort_then_release()

    def _refused(self, exc: BaseException) -> None:
        if self._over:
            self._abort_then_release()
            return
        error = refusal(exc, self._parsed.constraint_field)
        log.warning("generate failed", **log_ids(self.request_id, self._parsed), error=str(error))
        self._end()
        try:
            self._sink.error(error)
        finally:
            self._abort_then_release()

    def _engine_failed(self, exc: BaseException) -> None:
        """The engine failed (the output handler hands every request its error)."""
        if self._state.completion_tokens == 0:
            self._refused(exc)
            return
        message = describe(exc)
        log.error(
            "engine failed mid-stream", **log_ids(self.request_id, self._parsed), error=message
        )
        self._fail(f"engine error: {message}")

    def _fail(self, message: str) -> None:
        """End with an error: before any token as a status, after some as an ERROR final."""
        state = self._state
        self._end()
        try:
            if state.completion_tokens == 0:
                self._sink.error(EngineFailure(message))
            else:
                self._flush_held()
                self._sink.final(
                    worker_pb2.Final(
                        finish_reason=common_pb2.FINISH_REASON_ERROR,
                        error_message=message,
                        usage=common_pb2.Usage(
                            prompt_tokens=state.prompt_tokens,
                            completion_tokens=state.completion_tokens,
                        ),
                    )
                )
        finally:
            self._abort_then_release()

    def _end(self) -> None:
        self._over = True
        self._state.finished = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _send_abort(self) -> None:
        if self._abort_sent:
            return
        self._abort_sent = True
        task = asyncio.get_running_loop().create_task(self._abort())
        self._generations.keep(task)

    async def _abort(self) -> None:
        try:
            await self._generations.engine.llm.abort(self.request_id)
        except Exception:
            log.warning(
                "engine abort failed", **log_ids(self.request_id, self._parsed), exc_info=True
            )

    def _abort_then_release(self) -> None:
        """The id is released after the abort, so that a new request with the same id can
        never be aborted in its place. While the request is still being added, `start`
        does this once vLLM has it."""
        if not self._added:
            return

        async def abort_then_release() -> None:
            try:
                await self._abort()
            finally:
                self._release()

        task = asyncio.get_running_loop().create_task(abort_then_release())
        self._generations.keep(task)

    def _release(self) -> None:
        self._generations.release(self._state)
        if not self.done.done():
            self.done.set_result(None)


__all__ = ["EventSink", "StreamedRequest"]
