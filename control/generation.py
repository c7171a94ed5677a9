"""One generation, end to end: tokenize, route, stream from the worker, detokenize,
match stop strings, and finish with exactly one `Final`.

`run_generation` is an async generator of public `GenerateResponse` messages; both
`Generate` (streamed) and `Complete` (aggregated) consume it. Callers must close it
(`contextlib.aclosing`) so that an abandoned stream cancels the worker call at once.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence

import grpc
import structlog
from switchyard.v1 import common_pb2, generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.errors import InvalidArgument, NoHealthyWorker, WorkerFailed
from control.models import ModelEntry
from control.params import GenerationParams
from control.stops import StopMatcher

log = structlog.get_logger(__name__)

FinishReason = common_pb2.FinishReason
# Part of the client's deadline kept back so that TIME_LIMIT reaches the client in time.
DEADLINE_MARGIN_S = 0.02
PROMPT_CONTEXT_TOKENS = 5


def build_worker_request(
    params: GenerationParams, prompt_ids: Sequence[int], max_tokens: int
) -> worker_pb2.GenerateRequest:
    s = params.sampling
    sampling = common_pb2.SamplingParams()
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
    ):
        value = getattr(s, name)
        if value is not None:
            setattr(sampling, name, value)
    req = worker_pb2.GenerateRequest(
        request_id=params.request_id,
        prompt_token_ids=prompt_ids,
        sampling=sampling,
        max_tokens=max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        priority=params.priority,
    )
    if params.logprobs is not None:
        req.logprobs = params.logprobs
    return req


async def run_generation(
    entry: ModelEntry,
    params: GenerationParams,
    received_at: float,
    time_remaining: float | None,
) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    tok = entry.tokenizer
    if params.prompt_ids is not None:
        prompt_ids = list(params.prompt_ids)
    else:
        assert params.prompt_text is not None
        prompt_ids = tok.encode(params.prompt_text)
    max_tokens = entry.limits.bind(params, prompt_ids)
    worker = entry.pick_worker()
    wreq = build_worker_request(params, prompt_ids, max_tokens)

    final = generation_pb2.Final(
        request_id=params.request_id,
        worker=worker.address,
        engine=entry.info.label,
    )
    timeout: float | None = None
    if time_remaining is not None:
        timeout = time_remaining - min(DEADLINE_MARGIN_S, time_remaining / 10)
        if timeout <= 0:
            final.finish_reason = FinishReason.FINISH_REASON_TIME_LIMIT
            final.usage.prompt_tokens = len(prompt_ids)
            _set_timing(final, received_at, None)
            yield generation_pb2.GenerateResponse(final=final)
            return

    detok = tok.detokenizer(prompt_ids[-PROMPT_CONTEXT_TOKENS:], params.skip_special_tokens)
    matcher = StopMatcher(params.stop, include_stop=params.include_stop) if params.stop else None
    want_logprobs = params.logprobs is not None
    completion = 0
    first_token_at: float | None = None
    worker_final: worker_pb2.Final | None = None
    stop_string: str | None = None

    worker.in_flight += 1
    call = worker.stub.Generate(wreq, timeout=timeout)
    try:
        async for resp in call:
            if resp.WhichOneof("response") == "final":
                worker_final = resp.final
                break
            wchunk = resp.chunk
            ids = wchunk.token_ids
            completion += len(ids)
            if first_token_at is None:
                first_token_at = time.perf_counter()
            text = detok.push(ids)
            if matcher is not None:
                r = matcher.push(text)
                text, stop_string = r.text, r.stop
            chunk = generation_pb2.Chunk(text=text, token_ids=ids)
            if want_logprobs:
                _copy_logprobs(chunk, wchunk.logprobs, entry)
            yield generation_pb2.GenerateResponse(chunk=chunk)
            if stop_string is not None:
                call.cancel()  # the worker aborts the engine request
                break
    except grpc.aio.AioRpcError as e:
        code = e.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            final.finish_reason = FinishReason.FINISH_REASON_TIME_LIMIT
        elif completion == 0:
            raise _worker_error(worker.address, e) from e
        else:
            final.finish_reason = FinishReason.FINISH_REASON_ERROR
            final.error_message = f"worker {worker.address}: {code.name}: {e.details()}"
            log.warning("worker failed mid-stream", worker=worker.address, code=code.name)
    finally:
        worker.in_flight -= 1
        if not call.done():
            call.cancel()

    if worker_final is not None:
        tail = detok.flush()
        if matcher is not None:
            r = matcher.push(tail)
            tail, stop_string = r.text, r.stop
            if stop_string is None:
                tail += matcher.flush()
        if tail:
            yield generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(text=tail))
        final.usage.CopyFrom(worker_final.usage)
        final.timing.queue_ms = worker_final.queue_ms
        if stop_string is None:
            final.finish_reason = worker_final.finish_reason
            which = worker_final.WhichOneof("stop_reason")
            if which == "eos_token_id":
                final.eos_token_id = worker_final.eos_token_id
            elif which == "stop_token_id":
                final.stop_token_id = worker_final.stop_token_id
            if worker_final.error_message:
                final.error_message = f"worker {worker.address}: {worker_final.error_message}"
    else:
        final.usage.prompt_tokens = len(prompt_ids)
        final.usage.completion_tokens = completion
    if stop_string is not None:
        final.finish_reason = FinishReason.FINISH_REASON_STOP
        final.stop_string = stop_string
    _set_timing(final, received_at, first_token_at)
    yield generation_pb2.GenerateResponse(final=final)


def _set_timing(final: generation_pb2.Final, received_at: float, first: float | None) -> None:
    now = time.perf_counter()
    if first is not None:
        final.timing.time_to_first_token_ms = (first - received_at) * 1000.0
    final.timing.total_ms = (now - received_at) * 1000.0


def _copy_logprobs(
    chunk: generation_pb2.Chunk,
    src: Sequence[common_pb2.TokenLogprob],
    entry: ModelEntry,
) -> None:
    chunk.logprobs.extend(src)
    decode = entry.tokenizer.decode
    for lp in chunk.logprobs:
        for top in lp.top:
            top.token = decode([top.token_id], False)


def _worker_error(address: str, e: grpc.aio.AioRpcError) -> Exception:
    code = e.code()
    details = e.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument.one("request", f"rejected by worker {address}: {details}")
    if code == grpc.StatusCode.UNAVAILABLE:
        return NoHealthyWorker(f"worker {address} is unavailable: {details}")
    return WorkerFailed(address, f"{code.name}: {details}")
