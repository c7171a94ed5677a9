"""`switchyard.v1.Generation`: the public API, over grpc.aio.

Each handler binds the request's id and model to the log context, so every line logged
while serving it carries them. A `StatusError` becomes its status in one place
(`control.api.status`); anything else is a fault of ours: it is logged with its
traceback and the client hears INTERNAL with the request id, never grpc's UNKNOWN.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, NoReturn

import grpc
import structlog
from opentelemetry.trace import StatusCode
from switchyard.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from control.api.auth import current_caller
from control.api.status import abort_rpc, status_code
from control.errors import Internal, InvalidArgument, StatusError
from control.fleet.models import ModelEntry, ModelRegistry
from control.metrics import request_ended
from control.request.direct import ChunkSink, as_chunk_sink
from control.request.prepare import prepare
from control.request.run import Progress
from control.request.samples import Collected, run_samples
from control.text.params import MAX_SAMPLES, check_prompt_text, parse_request
from control.tracing import Span, SpanKind, extract, trace_id_of, tracer, with_span

log = structlog.get_logger(__name__)
Context = grpc.aio.ServicerContext[Any, Any]


async def _abort(context: Any, err: StatusError) -> NoReturn:
    log.debug("request rejected", error=str(err))
    await abort_rpc(context, err)


async def _fail(context: Any, exc: Exception, request_id: str) -> NoReturn:
    """An exception nobody expected: log it whole, tell the client INTERNAL."""
    log.error("request failed unexpectedly", exc_info=exc)
    await abort_rpc(context, Internal(f"internal error serving request {request_id}: {exc!r}"))


def _request_id(request: Any) -> str:
    """The client's id when it gave one (it is validated later), else a fresh one that
    the request then keeps."""
    if not request.request_id:
        request.request_id = uuid.uuid4().hex
    return str(request.request_id)[:128]


def _server_span(context: Context, rpc: str, request_id: str, model: str) -> Span:
    """The RPC's span: a child of the caller's `traceparent`, if it sent one."""
    return tracer.start_span(
        f"switchyard.{rpc}",
        context=extract(context.invocation_metadata()),
        kind=SpanKind.SERVER,
        attributes={
            "rpc.system": "grpc",
            "rpc.service": "switchyard.v1.Generation",
            "rpc.method": rpc,
            "switchyard.request_id": request_id,
            "switchyard.model": model,
        },
    )


def _end_span(span: Span, code: str) -> None:
    span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[code].value[0])
    if code != "OK":
        span.set_status(StatusCode.ERROR, code)
    span.end()


def _visible(model: str) -> bool:
    """Whether the caller's token may use `model` (ListModels shows only those)."""
    caller = current_caller()
    return caller is None or caller.models is None or model in caller.models


class GenerationServicer(generation_pb2_grpc.GenerationServicer):  # type: ignore[misc]
    def __init__(self, registry: ModelRegistry, stream_interval: int = 1) -> None:
        self._registry = registry
        self._stream_interval = stream_interval  # tokens per chunk, at least

    async def _responses(
        self,
        request: generation_pb2.GenerateRequest,
        context: Context,
        rpc: str,
        sink: ChunkSink | None = None,
    ) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        """One generation's messages, for Generate (streamed) and Complete (aggregated);
        its errors end the RPC with their status. Each RPC is counted once, by its
        status code (switchyard_requests_total). `sink`: Generate's stream, when chunks
        may be written to it directly (control.request.direct)."""
        received = time.perf_counter()
        request_id = _request_id(request)
        entry: ModelEntry | None = None
        code = "OK"
        progress = Progress()
        span = _server_span(context, rpc, request_id, request.model)
        ids: dict[str, str] = {"request_id": request_id, "model": request.model}
        trace_id = trace_id_of(span)
        if trace_id is not None:
            ids["trace_id"] = trace_id
        with structlog.contextvars.bound_contextvars(**ids):
            try:
                params = parse_request(request)
                entry = self._registry.get(params.model)
                caller = current_caller()
                if caller is not None:
                    caller.check_model(entry.name)
                prepared = await prepare(
                    entry, params, received, context.time_remaining(), self._stream_interval
                )
                gen = run_samples(prepared, progress, with_span(span), caller, sink)
                async with contextlib.aclosing(gen):
                    async for resp in gen:
                        yield resp
            except StatusError as e:
                code = status_code(e).name
                await _abort(context, e)
            except (asyncio.CancelledError, GeneratorExit):
                # The client went away, or its deadline passed, before the Final.
                if not progress.over:
                    left = context.time_remaining()
                    expired = left is not None and left <= 0
                    code = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
                    if entry is not None:
                        entry.metrics.cancelled("deadline" if expired else "client")
                raise
            except Exception as e:
                code = "INTERNAL"
                await _fail(context, e, request_id)
            finally:
                self._count(entry, request.model, rpc, code)
                _end_span(span, code)

    def _count(self, entry: ModelEntry | None, model: str, rpc: str, code: str) -> None:
        if entry is None:  # a name the client made up must not become a series
            entry = self._registry.find(model)
        if entry is None:
            request_ended("", rpc, code)
        else:
            entry.metrics.request_ended(rpc, code)

    async def Generate(
        self, request: generation_pb2.GenerateRequest, context: Context
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        # The native front's calls take chunks where they arrive; grpc.aio's do not.
        sink = as_chunk_sink(context)
        responses = self._responses(request, context, "Generate", sink)
        async with contextlib.aclosing(responses):
            async for resp in responses:
                yield resp

    async def Complete(
        self, request: generation_pb2.GenerateRequest, context: Context
    ) -> generation_pb2.CompleteResponse:
        collected = Collected()
        responses = self._responses(request, context, "Complete")
        async with contextlib.aclosing(responses):
            async for resp in responses:
                collected.add(resp)
        return collected.response()

    async def Tokenize(
        self, request: generation_pb2.TokenizeRequest, context: Context
    ) -> generation_pb2.TokenizeResponse:
        code = "OK"
        with structlog.contextvars.bound_contextvars(model=request.model):
            try:
                entry = self._registry.get(request.model)
                caller = current_caller()
                if caller is not None:
                    caller.check_model(entry.name)
                too_long = check_prompt_text("text", request.text)
                if too_long is not None:
                    raise InvalidArgument([too_long])
                add_special = (
                    request.add_special_tokens if request.HasField("add_special_tokens") else True
                )
                ids = await entry.tokenizer.encode_off_loop(request.text, add_special)
                return generation_pb2.TokenizeResponse(
                    token_ids=ids, tokens=entry.tokenizer.tokens(ids)
                )
            except StatusError as e:
                code = status_code(e).name
                await _abort(context, e)
            except Exception as e:
                code = "INTERNAL"
                await _fail(context, e, "tokenize")
            finally:
                self._count(None, request.model, "Tokenize", code)

    async def ListModels(
        self, request: generation_pb2.ListModelsRequest, context: Context
    ) -> generation_pb2.ListModelsResponse:
        models = [
            generation_pb2.ModelInfo(
                name=e.name,
                engine=e.info.label,
                max_context=e.info.max_context,
                vocab_size=e.info.vocab_size,
                healthy_workers=len(e.healthy_workers()),
                workers=len(e.workers),
                capabilities=_served_capabilities(e),
            )
            for e in self._registry.all()
            if _visible(e.name)
        ]
        return generation_pb2.ListModelsResponse(models=models)


def _served_capabilities(entry: ModelEntry) -> common_pb2.Capabilities | None:
    """What the model can do through Switchyard: its workers' engine, with n up to the
    control plane's fan-out (it samples n as separate engine requests on every engine)."""
    caps = entry.info.capabilities
    if caps is None:
        return None
    out = caps.to_proto()
    out.max_n = max(out.max_n, MAX_SAMPLES)
    return out
