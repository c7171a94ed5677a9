"""`switchyard.v1.Generation`: the public API, over grpc.aio."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
import structlog
from switchyard.v1 import generation_pb2, generation_pb2_grpc

from control.api.status import abort_rpc
from control.errors import SwitchyardError
from control.fleet.models import ModelRegistry
from control.request.generation import run_generation
from control.text.params import parse_request

log = structlog.get_logger(__name__)


async def _abort(context: Any, err: SwitchyardError) -> NoReturn:
    log.debug("request rejected", error=str(err))
    await abort_rpc(context, err)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):  # type: ignore[misc]
    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry

    async def Generate(
        self,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        received = time.perf_counter()
        try:
            params = parse_request(request)
            entry = self._registry.get(params.model)
            gen = run_generation(entry, params, received, context.time_remaining())
            async with contextlib.aclosing(gen):
                async for resp in gen:
                    yield resp
        except SwitchyardError as e:
            await _abort(context, e)

    async def Complete(
        self,
        request: generation_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> generation_pb2.CompleteResponse:
        received = time.perf_counter()
        out = generation_pb2.CompleteResponse()
        texts: list[str] = []
        try:
            params = parse_request(request)
            entry = self._registry.get(params.model)
            gen = run_generation(entry, params, received, context.time_remaining())
            async with contextlib.aclosing(gen):
                async for resp in gen:
                    if resp.HasField("chunk"):
                        texts.append(resp.chunk.text)
                        out.token_ids.extend(resp.chunk.token_ids)
                        out.logprobs.extend(resp.chunk.logprobs)
                    else:
                        out.final.CopyFrom(resp.final)
        except SwitchyardError as e:
            await _abort(context, e)
        out.text = "".join(texts)
        return out

    async def Tokenize(
        self,
        request: generation_pb2.TokenizeRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> generation_pb2.TokenizeResponse:
        try:
            entry = self._registry.get(request.model)
        except SwitchyardError as e:
            await _abort(context, e)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = entry.tokenizer.encode(request.text, add_special_tokens=add_special)
        return generation_pb2.TokenizeResponse(token_ids=ids, tokens=entry.tokenizer.tokens(ids))

    async def ListModels(
        self,
        request: generation_pb2.ListModelsRequest,
        context: grpc.aio.ServicerContext[object, object],
    ) -> generation_pb2.ListModelsResponse:
        models = [
            generation_pb2.ModelInfo(
                name=e.name,
                engine=e.info.label,
                max_context=e.info.max_context,
                vocab_size=e.info.vocab_size,
                healthy_workers=len(e.healthy_workers()),
                workers=len(e.workers),
            )
            for e in self._registry.all()
        ]
        return generation_pb2.ListModelsResponse(models=models)
