"""The asyncio client: the same calls as `Client`, awaited.

```python
from switchyard.client import AsyncClient

async with AsyncClient("127.0.0.1:50051") as client:
    stream = client.generate("tiny", "Hello", max_tokens=16)
    async for chunk in stream:
        print(chunk.text, end="")
    print(stream.final.usage)
```

`await stream.aclose()` (or `async with stream:`) cancels a generation still running;
a stream left behind after a `break` is cancelled once it is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import grpc
from switchyard.v1 import admin_pb2, admin_pb2_grpc, generation_pb2, generation_pb2_grpc

from switchyard.client._common import (
    CHANNEL_OPTIONS,
    Finals,
    Metadata,
    Outcome,
    Prompt,
    RetryPolicy,
    Tls,
    deadline_of,
    drain_request,
    generate_request,
    metadata,
    remaining,
    tokenize_request,
    unload_adapter_request,
    unload_request,
)
from switchyard.client.errors import from_rpc_error
from switchyard.client.types import (
    Chunk,
    Completion,
    ModelInfo,
    Tokens,
    chunk_of,
    completion_of,
    final_of,
    model_of,
    tokens_of,
)

_EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]


class AsyncStream(Finals):
    """The chunks of one generation; `final` once it has ended. `aclose()`, or dropping
    it, cancels a generation still running."""

    def __init__(
        self,
        start: Callable[[float | None], Any],
        deadline: float | None,
        retry: RetryPolicy,
        samples: int = 1,
    ) -> None:
        self._outcome = Outcome(samples)
        self._chunks = _run(start, deadline, retry, self._outcome)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        return await self._chunks.__anext__()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop listening; a generation still running is cancelled."""
        await self._chunks.aclose()


async def _first(
    start: Callable[[float | None], Any], deadline: float | None, retry: RetryPolicy
) -> tuple[Any, Any]:
    attempt = 0
    while True:
        call = start(remaining(deadline))
        try:
            msg = await call.read()
            return call, None if msg is _EOF else msg
        except grpc.aio.AioRpcError as e:
            err = from_rpc_error(e)
            wait = retry.delay(err, attempt, deadline)
            if wait is None:
                raise err from None
            await asyncio.sleep(wait)
            attempt += 1


async def _run(
    start: Callable[[float | None], Any],
    deadline: float | None,
    retry: RetryPolicy,
    outcome: Outcome,
) -> AsyncGenerator[Chunk, None]:
    call, msg = await _first(start, deadline, retry)
    try:
        while msg is not None:
            if msg.HasField("final"):
                outcome.add(final_of(msg.final))
            else:
                yield chunk_of(msg.chunk)
            nxt = await call.read()
            msg = None if nxt is _EOF else nxt
    except grpc.aio.AioRpcError as e:
        raise from_rpc_error(e) from None
    finally:
        if not outcome.ended:  # dropped or failed before the end: stop every sample
            call.cancel()


class AsyncClient:
    """`Client`, for asyncio. Create it inside the event loop that uses it."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: Tls | bool = False,
        timeout: float | None = 60.0,
        retry: RetryPolicy | None = None,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.address = address
        self.token = token
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        if channel is None:
            if tls:
                creds = (tls if isinstance(tls, Tls) else Tls()).credentials()
                channel = grpc.aio.secure_channel(address, creds, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.channel = channel
        self._gen = generation_pb2_grpc.GenerationStub(channel)
        self._admin = admin_pb2_grpc.AdminStub(channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close(None)

    def _md(self, traceparent: str | None, extra: Sequence[tuple[str, str]]) -> Metadata:
        return metadata(self.token, traceparent, extra)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        try:
            return await method(
                request, timeout=self._timeout(timeout), metadata=self._md(None, ())
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None

    def generate(
        self,
        model: str,
        prompt: Prompt,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        **options: Any,
    ) -> AsyncStream:
        req = generate_request(model, prompt, **options)
        md = self._md(traceparent, metadata)

        def start(left: float | None) -> Any:
            return self._gen.Generate(req, timeout=left, metadata=md)

        return AsyncStream(start, deadline_of(self._timeout(timeout)), self.retry, req.n or 1)

    async def complete(
        self,
        model: str,
        prompt: Prompt,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        **options: Any,
    ) -> Completion:
        req = generate_request(model, prompt, **options)
        md = self._md(traceparent, metadata)
        deadline = deadline_of(self._timeout(timeout))
        attempt = 0
        while True:
            try:
                out = await self._gen.Complete(req, timeout=remaining(deadline), metadata=md)
                return completion_of(out)
            except grpc.aio.AioRpcError as e:
                err = from_rpc_error(e)
                wait = self.retry.delay(err, attempt, deadline)
                if wait is None:
                    raise err from None
                await asyncio.sleep(wait)
                attempt += 1

    async def tokenize(
        self,
        model: str,
        text: str,
        *,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> Tokens:
        req = tokenize_request(model, text, add_special_tokens)
        out = await self._unary(self._gen.Tokenize, req, timeout)
        return tokens_of(out)

    async def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        out = await self._unary(self._gen.ListModels, generation_pb2.ListModelsRequest(), timeout)
        return [model_of(m) for m in out.models]

    async def workers(self, model: str = "", *, timeout: float | None = None) -> list[Any]:
        req = admin_pb2.ListWorkersRequest(model=model)
        return list((await self._unary(self._admin.ListWorkers, req, timeout)).workers)

    async def load_model(self, spec: admin_pb2.ModelSpec, *, timeout: float | None = 600.0) -> Any:
        req = admin_pb2.LoadModelRequest(spec=spec)
        return await self._unary(self._admin.LoadModel, req, timeout)

    async def unload_model(
        self, name: str, *, grace_s: float | None = None, timeout: float | None = 600.0
    ) -> Any:
        req = unload_request(name, grace_s)
        return await self._unary(self._admin.UnloadModel, req, timeout)

    async def load_adapter(
        self, model: str, name: str, path: str, *, timeout: float | None = 600.0
    ) -> Any:
        """Load a LoRA adapter (a directory every worker of the model can read) on every
        worker of `model`; requests then name it (`adapter=`)."""
        req = admin_pb2.LoadAdapterRequest(model=model, name=name, path=path)
        return await self._unary(self._admin.LoadAdapter, req, timeout)

    async def unload_adapter(
        self,
        model: str,
        name: str,
        *,
        grace_s: float | None = None,
        timeout: float | None = 600.0,
    ) -> Any:
        """Stop new requests for it; wait up to `grace_s` for those in flight."""
        req = unload_adapter_request(model, name, grace_s)
        return await self._unary(self._admin.UnloadAdapter, req, timeout)

    async def adapters(self, model: str = "", *, timeout: float | None = None) -> list[Any]:
        req = admin_pb2.ListAdaptersRequest(model=model)
        return list((await self._unary(self._admin.ListAdapters, req, timeout)).adapters)

    async def drain(
        self, address: str, *, grace_s: float | None = None, timeout: float | None = 600.0
    ) -> Any:
        req = drain_request(address, grace_s)
        return await self._unary(self._admin.DrainWorker, req, timeout)
