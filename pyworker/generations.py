"""Generation on the engine, whatever carries it: validate and admit a request, run it
on vLLM's `AsyncLLM`, and end it with exactly one Final or one error, through a `Sink`.

The RPC adapters (`servicer.py` for `Generate`, `session.py` for `GenerateStream`) only
say where the messages go. Token ids in, token ids out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any, Protocol

import structlog
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from pyworker import beams
from pyworker.adapters import Adapter, Adapters
from pyworker.engine import Engine
from pyworker.engine_errors import describe, refusal
from pyworker.errors import (
    AlreadyExists,
    EngineFailure,
    FailedPrecondition,
    InvalidArgument,
    StatusError,
    Unavailable,
)
from pyworker.load import InFlight, TokenRate
from pyworker.request import ParsedGenerate, log_ids, parse_generate
from pyworker.resume_grammar import CannotResume, ResumeGrammars, ResumeGuard

log = structlog.get_logger(__name__)

ABORTED_END_S = 10.0  # how long an unload waits for the requests it aborted to end

_FINISH_REASONS = {
    "length": common_pb2.FINISH_REASON_LENGTH,
    "stop": common_pb2.FINISH_REASON_STOP,
    "repetition": common_pb2.FINISH_REASON_STOP,
    "abort": common_pb2.FINISH_REASON_CANCELLED,
    "error": common_pb2.FINISH_REASON_ERROR,
}


class StreamClosed(Exception):
    """Writing to the RPC failed: the client is gone, nobody reads the rest."""


class Sink(Protocol):
    """Where one request's messages go: its own Generate call, or a GenerateStream."""

    # Whether sending waits on the network (then the deadline pauses around it).
    blocking: bool

    async def chunk(self, chunk: Any) -> None: ...

    async def final(self, final: Any) -> None: ...

    async def time_limit(self, final: Any) -> None:
        """The TIME_LIMIT final, after the deadline aborted the request."""

    async def error(self, exc: StatusError) -> None:
        """The request failed before its first token."""


class Generations:
    """Every request in flight on one engine, whichever RPC brought it."""

    def __init__(self, engine: Engine, *, rate_window_s: float = 2.0) -> None:
        self._engine = engine
        self._inflight: dict[str, InFlight] = {}
        self._rate = TokenRate(window_s=rate_window_s)
        self._background: set[asyncio.Task[None]] = set()
        self.adapters = Adapters(engine.info.lora)
        self._unloads: set[asyncio.Task[tuple[int, int]]] = set()
        self._resume: ResumeGrammars | None = None  # built at the first constrained resume

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def count_tokens(self, n: int) -> None:
        self._rate.add(n)

    def keep(self, task: asyncio.Task[None]) -> None:
        """Hold a background task (an abort) until it is done."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def admit(self, request: Any, request_id: str) -> tuple[InFlight, ParsedGenerate]:
        """Validate a request and count it in flight as the engine's `request_id`;
        raises `StatusError`. The caller must `release` it unless `serve` runs."""
        try:
            parsed = parse_generate(request, self._engine.info)
            if self._engine.errored:
                raise Unavailable("the engine is dead; this worker is restarting")
            if request_id in self._inflight:
                raise AlreadyExists(f"request_id {request_id!r} is already in flight")
            if parsed.adapter:
                lora = self.adapters.acquire(parsed.adapter, request_id)
                parsed = dataclasses.replace(parsed, lora_request=lora)
        except StatusError as exc:
            log.info("generate rejected", request_id=request_id, code=exc.code.name, error=str(exc))
            raise
        state = InFlight(
            request_id, prompt_tokens=len(parsed.prompt_token_ids), adapter=parsed.adapter
        )
        self._inflight[request_id] = state
        return state, parsed

    async def serve(
        self,
        parsed: ParsedGenerate,
        state: InFlight,
        sink: Sink,
        arrived: float,
        deadline: float | None,
    ) -> None:
        """Run one admitted request to its end: a Final, or an error before the first
        token, through `sink`. Cancellation aborts the engine request."""
        ids = log_ids(state.request_id, parsed)
        try:
            await self._stream(parsed, state, sink, arrived, deadline)
        except TimeoutError:
            if state.finished:  # the deadline fell just after the final went out
                return
            # The engine request is aborted; the caller, still listening, hears TIME_LIMIT.
            log.info("generate deadline expired", **ids)
            await self._guard_abort(state)
            final = worker_pb2.Final(
                finish_reason=common_pb2.FINISH_REASON_TIME_LIMIT,
                usage=common_pb2.Usage(
                    prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens
                ),
            )
            await sink.time_limit(final)
        except StatusError as exc:
            log.warning("generate failed", **ids, error=str(exc))
            await self._guard_abort(state)
            await sink.error(exc)
        except StreamClosed:
            log.info("generate stream closed by the client", **ids)
        except Exception as exc:  # a fault outside the relay: the request still ends
            log.error("generate failed unexpectedly", **ids, exc_info=exc)
            ended = state.finished
            await self._guard_abort(state)
            if not ended:
                with contextlib.suppress(StreamClosed):
                    await self._fail_unexpectedly(exc, state, sink)
        finally:
            # Cancellation (client gone, deadline) lands here too: generate() aborts on
            # its own when cancelled; this guard covers the gaps around it. The id is
            # released after the abort, so that a new request with the same id can never
            # be aborted in its place.
            try:
                await self._guard_abort(state)
            finally:
                self.release(state)

    async def _fail_unexpectedly(self, exc: Exception, state: InFlight, sink: Sink) -> None:
        if state.completion_tokens == 0:
            await sink.error(EngineFailure(f"worker error: {exc!r}"))
            return
        final = worker_pb2.Final(
            finish_reason=common_pb2.FINISH_REASON_ERROR,
            error_message=f"worker error: {exc!r}",
            usage=common_pb2.Usage(
                prompt_tokens=state.prompt_tokens, completion_tokens=state.completion_tokens
            ),
        )
        await sink.final(final)

    async def check_resume(self, parsed: ParsedGenerate) -> ResumeGuard | None:
        """For a resumed constrained request: compile its constraint and advance it past
        the output so far, as the engine will, off the event loop; the guard that checks
        the engine's tokens against it. FAILED_PRECONDITION naming why when it cannot
        continue from there (never an unconstrained output)."""
        spec = parsed.resume_spec
        if spec is None:
            return None
        if self._resume is None:
            self._resume = ResumeGrammars(self._engine.llm.vllm_config)
        stops = getattr(parsed.sampling_params, "all_stop_token_ids", None) or ()
        try:
            return ResumeGuard(await asyncio.to_thread(self._resume.primed, spec, stops))
        except CannotResume as exc:
            raise FailedPrecondition.for_field(
                "resume_token_ids",
                f"the constraint cannot continue after these {len(spec.output)} tokens: {exc}",
            ) from exc

    def release(self, state: InFlight) -> None:
        """Forget an admitted request (idempotent); also for one whose `serve` never ran
        (a start cancelled before its task began)."""
        if self._inflight.get(state.request_id) is state:
            del self._inflight[state.request_id]
            if state.adapter:
                self.adapters.release(state.adapter, state.request_id)

    async def _stream(
        self,
        parsed: ParsedGenerate,
        state: InFlight,
        sink: Sink,
        arrived: float,
        deadline: float | None,
    ) -> None:
        """Relay the engine's outputs. Only waiting on the engine counts against the
        deadline (TimeoutError); a write to the client is never interrupted half-way."""
        if parsed.beam_width > 1:
            await self._beam_search(parsed, state, sink, arrived, deadline)
            return
        llm = self._engine.llm
        completion_tokens = 0
        interval = parsed.stream_interval  # tokens per chunk after the first
        held: worker_pb2.Chunk | None = None  # tokens kept back for that cadence
        cached_tokens = 0
        last_token: int | None = None
        first_token_at: float | None = None
        outputs: AsyncIterator[Any] = llm.generate(
            self._engine.make_prompt(parsed.engine_prompt),
            parsed.sampling_params,
            state.request_id,
            priority=parsed.priority,
            trace_headers=self._engine.trace_headers(parsed.trace_headers),
            lora_request=parsed.lora_request,
        )
        try:
            # After the finished output the generator ends by itself; leaving the loop
            # early would make it abort a request that is already done.
            loop = asyncio.get_running_loop()
            when = None if deadline is None else loop.time() + (deadline - time.monotonic())
            async with asyncio.timeout_at(when) as budget:
                guard = await self.check_resume(parsed)  # before the engine sees it
                async for out in outputs:
                    completion = out.outputs[0]
                    cached_tokens = int(getattr(out, "num_cached_tokens", None) or cached_tokens)
                    if state.aborted:
                        if not out.finished:
                            # The Abort RPC came before the engine knew this request.
                            await llm.abort(state.request_id)
                            continue
                    else:
                        token_ids = list(completion.token_ids)
                        if guard is not None:
                            guard.feed(token_ids)
                        if token_ids:
                            chunk = worker_pb2.Chunk(token_ids=token_ids)
                            if first_token_at is None:
                                first_token_at = time.monotonic()
                                chunk.prompt_logprobs.extend(prompt_logprobs(parsed, out) or ())
                            if parsed.logprobs is not None and completion.logprobs:
                                chunk.logprobs.extend(
                                    logprobs(token_ids, completion.logprobs, parsed.logprobs)
                                )
                            if held is not None:
                                held.MergeFrom(chunk)
                                chunk, held = held, None
                            if completion_tokens and len(chunk.token_ids) < interval:
                                held = chunk  # the stream's cadence: not yet
                            elif sink.blocking:
                                await _outside(budget, when, sink.chunk(chunk))
                            else:
                                await sink.chunk(chunk)
                            completion_tokens += len(token_ids)
                            state.completion_tokens = completion_tokens
                            last_token = token_ids[-1]
                            self._rate.add(len(token_ids))
                    if out.finished:
                        if held is not None:  # the tokens kept back go out before the end
                            await _outside(budget, when, sink.chunk(held))
                            held = None
                        # Built before the request counts as finished, so that a fault
                        # here still ends it with an error rather than with nothing.
                        final = self.final_for(parsed, state, completion, last_token, guard)
                        final.usage.prompt_tokens = len(parsed.prompt_token_ids)
                        final.usage.completion_tokens = completion_tokens
                        final.usage.cached_prompt_tokens = min(
                            cached_tokens, len(parsed.prompt_token_ids)
                        )
                        final.queue_ms = queue_ms(getattr(out, "metrics", None))
                        if first_token_at is not None:
                            final.time_to_first_token_ms = (first_token_at - arrived) * 1000.0
                        state.finished = True
                        await _outside(budget, when, sink.final(final))
        except (asyncio.CancelledError, StatusError, StreamClosed):
            raise
        except TimeoutError:
            if held is not None:  # generated in time: they go out before TIME_LIMIT
                await sink.chunk(held)
            raise
        except Exception as exc:
            if state.finished:  # the Final is out; nothing left to tell the client
                log.warning("engine error after the final", request_id=state.request_id)
                return
            if held is not None:
                await sink.chunk(held)
            await self._engine_error(exc, state, sink, completion_tokens, parsed)
            return
        finally:
            with contextlib.suppress(Exception):
                await outputs.aclose()  # type: ignore[attr-defined]
        if not state.finished:
            await self._engine_error(
                RuntimeError("the engine ended the stream without finishing the request"),
                state,
                sink,
                completion_tokens,
                parsed,
            )

    async def _beam_search(
        self,
        parsed: ParsedGenerate,
        state: InFlight,
        sink: Sink,
        arrived: float,
        deadline: float | None,
    ) -> None:
        """One beam search, answered with one Final that carries every beam. An Abort
        cancels the search's task (its engine requests have ids of their own)."""
        llm = self._engine.llm
        prompt = self._engine.make_prompt(parsed.prompt_token_ids)
        task = asyncio.ensure_future(
            beams.search(
                llm,
                prompt,
                state.request_id,
                parsed.beam_width,
                parsed.sampling_params,
                parsed.lora_request,
                self._engine.trace_headers(parsed.trace_headers),
            )
        )
        state.on_abort = task.cancel
        loop = asyncio.get_running_loop()
        when = None if deadline is None else loop.time() + (deadline - time.monotonic())
        try:
            async with asyncio.timeout_at(when):
                final = await task
        except asyncio.CancelledError as exc:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the caller went away: nothing to answer
            if not state.aborted:  # the search's own task, cancelled by neither
                raise EngineFailure("the beam search was cancelled in the engine") from exc
            final = worker_pb2.Final(finish_reason=common_pb2.FINISH_REASON_CANCELLED)
        except (TimeoutError, StatusError):
            raise
        except Exception as exc:
            raise refusal(exc) from exc
        finally:
            state.on_abort = None
        if state.aborted:
            final = worker_pb2.Final(finish_reason=common_pb2.FINISH_REASON_CANCELLED)
        final.usage.prompt_tokens = len(parsed.prompt_token_ids)
        final.time_to_first_token_ms = (time.monotonic() - arrived) * 1000.0
        state.completion_tokens = final.usage.completion_tokens
        self._rate.add(state.completion_tokens)
        state.finished = True
        await sink.final(final)

    async def _engine_error(
        self,
        exc: BaseException,
        state: InFlight,
        sink: Sink,
        completion_tokens: int,
        parsed: ParsedGenerate,
    ) -> None:
        message = describe(exc)
        if completion_tokens == 0:
            raise refusal(exc, parsed.constraint_field) from exc
        log.error("engine failed mid-stream", request_id=state.request_id, error=message)
        await self._guard_abort(state)
        final = worker_pb2.Final(
            finish_reason=common_pb2.FINISH_REASON_ERROR,
            error_message=f"engine error: {message}",
            usage=common_pb2.Usage(
                prompt_tokens=len(parsed.prompt_token_ids), completion_tokens=completion_tokens
            ),
        )
        state.finished = True
        await sink.final(final)

    def final_for(
        self,
        parsed: ParsedGenerate,
        state: InFlight,
        completion: Any,
        last_token: int | None,
        guard: ResumeGuard | None = None,
    ) -> Any:
        """A Final with the finish and stop reasons; the caller fills usage and timing.
        A resumed constrained output that broke its constraint ends with ERROR."""
        reason = str(completion.finish_reason) if completion.finish_reason is not None else ""
        final = worker_pb2.Final()
        if state.aborted:
            final.finish_reason = common_pb2.FINISH_REASON_CANCELLED
            return final
        broken = guard.check_end(reason == "stop") if guard is not None else None
        if broken is not None:
            log.error("resumed output broke its constraint", request_id=state.request_id)
            final.finish_reason = common_pb2.FINISH_REASON_ERROR
            final.error_message = f"the resumed output broke its constraint: {broken}"
            return final
        final.finish_reason = _FINISH_REASONS.get(reason, common_pb2.FINISH_REASON_STOP)
        if reason == "error":
            final.error_message = "the engine failed this request"
        elif reason == "stop":
            stop_reason = completion.stop_reason
            if last_token is not None and last_token in self._engine.info.eos_token_ids:
                final.eos_token_id = last_token
            elif isinstance(stop_reason, int) and not isinstance(stop_reason, bool):
                final.stop_token_id = stop_reason
            elif last_token is not None and last_token in parsed.stop_token_ids:
                final.stop_token_id = last_token
        return final

    async def _guard_abort(self, state: InFlight) -> None:
        if state.finished:
            return
        state.finished = True
        try:
            await self._engine.llm.abort(state.request_id)
        except Exception:
            log.warning("engine abort failed", request_id=state.request_id, exc_info=True)

    async def abort(self, request_ids: Iterable[str]) -> int:
        """Abort the requests in flight among `request_ids` (their streams end with a
        CANCELLED final); how many there were. Raises EngineFailure."""
        ids = [
            rid
            for rid in dict.fromkeys(request_ids)
            if (state := self._inflight.get(rid)) is not None and not state.finished
        ]
        for rid in ids:
            state = self._inflight[rid]
            state.aborted = True
            if state.on_abort is not None:
                state.on_abort()
        if ids:
            try:
                await self._engine.llm.abort(ids)
            except Exception as exc:
                log.error("engine abort failed", request_ids=ids, exc_info=True)
                raise EngineFailure(f"engine abort failed: {describe(exc)}") from exc
            log.info("aborted", request_ids=ids)
        return len(ids)

    async def load_adapter(self, name: str, path: str) -> Adapter:
        """Load a LoRA adapter into the engine ahead of its requests (vLLM's add_lora);
        loading the one already held under that name and path again is a no-op."""
        held = self.adapters.check_load(name, path)
        if held is not None:
            return held
        lora, lora_id = self.adapters.new_request(name, path)
        with self.adapters.loading(name):
            try:
                await self._engine.llm.add_lora(lora)
            except Exception as exc:
                log.warning("adapter failed to load", adapter=name, path=path, exc_info=True)
                raise InvalidArgument.for_field(
                    "path", f"the engine could not load the adapter: {describe(exc)}"
                ) from exc
            return self.adapters.add(name, path, lora, lora_id)

    async def unload_adapter(self, name: str, grace_s: float) -> tuple[int, int]:
        """Stop new requests for the adapter at once, wait up to `grace_s` for those
        in flight, cancel the rest, then drop it from the engine: (drained, cancelled)."""
        adapter = self.adapters.begin_unload(name)
        # Its own task: a caller that gives up (a deadline) does not leave it half done.
        task = asyncio.get_running_loop().create_task(self._unload(adapter, grace_s))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)
        return await asyncio.shield(task)

    async def _unload(self, adapter: Adapter, grace_s: float) -> tuple[int, int]:
        at_start = len(adapter.in_flight)
        cancelled = 0
        try:
            try:
                await asyncio.wait_for(adapter.idle.wait(), grace_s)
            except TimeoutError:
                cancelled = await self.abort(list(adapter.in_flight))
                with contextlib.suppress(TimeoutError):  # aborted requests end promptly
                    await asyncio.wait_for(adapter.idle.wait(), ABORTED_END_S)
            try:
                await self._engine.llm.remove_lora(adapter.lora_id)
            except Exception:  # the engine may drop it later; the name is gone either way
                log.warning("engine remove_lora failed", adapter=adapter.name, exc_info=True)
        finally:
            self.adapters.remove(adapter)  # however it went: the name is free again
        drained = at_start - cancelled
        log.info("adapter unload done", adapter=adapter.name, drained=drained, cancelled=cancelled)
        return drained, cancelled

    def load_report(self) -> Any:
        """The current load, with stale engine stats bounded by the worker's own count."""
        snap = self._engine.load.snapshot()
        in_flight = len(self._inflight)
        running = min(snap.running, in_flight)
        waiting = min(snap.waiting, in_flight - running)
        usage = min(max(snap.kv_cache_usage, 0.0), 1.0)
        total = self._engine.info.kv_blocks_total
        used = min(total, round(usage * total))
        return worker_pb2.LoadReport(
            running=running,
            waiting=waiting,
            kv_cache_usage=usage,
            kv_blocks_used=used,
            kv_blocks_free=total - used,
            generation_tokens_per_s=self._rate.rate(),
            in_flight=in_flight,
            gpu_memory_used_bytes=self._engine.gpu.read().used_bytes,
            timestamp_s=time.time(),
        )


async def _outside(budget: asyncio.Timeout, when: float | None, send: Awaitable[None]) -> None:
    """Send with the deadline paused: it covers waiting on the engine, and a write cut
    off half-way would leave the stream unusable for the TIME_LIMIT final."""
    budget.reschedule(None)
    try:
        await send
    finally:
        budget.reschedule(when)


def logprobs(token_ids: list[int], positions: Iterable[Any], top_n: int) -> list[Any]:
    """One TokenLogprob per token: the chosen token's logprob and the top-n alternatives."""
    result = []
    for token_id, position in zip(token_ids, positions, strict=False):
        if not position:
            result.append(common_pb2.TokenLogprob(token_id=token_id, logprob=math.nan))
            continue
        chosen = position.get(token_id)
        ranked = sorted(
            position.items(),
            key=lambda item: (
                item[1].rank if item[1].rank is not None else math.inf,
                -item[1].logprob,
            ),
        )[:top_n]
        result.append(
            common_pb2.TokenLogprob(
                token_id=token_id,
                logprob=chosen.logprob if chosen is not None else math.nan,
                top=[common_pb2.TopLogprob(token_id=t, logprob=lp.logprob) for t, lp in ranked],
            )
        )
    return result


def prompt_logprobs(parsed: ParsedGenerate, out: Any) -> list[Any] | None:
    """The prompt's logprobs from the first output, when they were asked: one per prompt
    token after the first (vLLM has None for the first, which nothing predicts)."""
    if parsed.prompt_logprobs is None or not getattr(out, "prompt_logprobs", None):
        return None
    return logprobs(parsed.prompt_token_ids[1:], out.prompt_logprobs[1:], parsed.prompt_logprobs)


def queue_ms(metrics: Any) -> float:
    """Engine arrival until first scheduled, from vLLM's per-request stats if present."""
    if metrics is None:
        return 0.0
    queued = getattr(metrics, "queued_ts", 0.0) or 0.0
    scheduled = getattr(metrics, "scheduled_ts", 0.0) or 0.0
    if queued > 0 and scheduled >= queued:
        return float(scheduled - queued) * 1000.0
    in_queue = getattr(metrics, "time_in_queue", None)  # older releases
    return float(in_queue) * 1000.0 if in_queue else 0.0
