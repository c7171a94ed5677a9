"""The bytes of a request, before they are a message: how every Switchyard Python
server registers its services.

grpc.aio parses a request body before the handler runs, and a body that is not a valid
encoding (a client built from a stale `.proto`, a truncated frame, a scanner) ends the
call UNKNOWN with a Python class name in the message: a status that blames nobody. So
each handler is registered here with no deserializer and parses the body itself. A body
that does not parse ends its call INVALID_ARGUMENT, naming the message type expected,
with a `BadRequest` on the field `request`; it is logged once at info level with the
peer. On a bidirectional stream a message that does not parse ends that stream alone.

A call whose metadata (headers, counted as HTTP/2 counts a header list: name, value and
32 bytes each) is over `max_metadata_bytes` ends RESOURCE_EXHAUSTED, whether or not the
client kept to the limit the server advertised. A call whose request message does not
arrive within `request_idle_s` of the call starting ends DEADLINE_EXCEEDED: a client
that opens a stream and never sends holds no slot for longer than that. Streams whose
requests are a stream (GenerateStream, reflection) may idle as long as they like.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from switchyard_common.rpc_status import FieldViolation, status_trailers

__all__ = ["DEFAULT_MAX_METADATA_BYTES", "DEFAULT_REQUEST_IDLE_S", "Wire", "malformed_message"]

log = structlog.get_logger(__name__)

# How long a call may wait for its request message (the documented default).
DEFAULT_REQUEST_IDLE_S = 30.0
# A call's metadata, at most: grpc's own hard limit, which it advertises to clients.
DEFAULT_MAX_METADATA_BYTES = 16384

# (full method name) -> None: told of each malformed body, e.g. to count it.
MalformedHook = Callable[[str], None]
Handler = Any  # grpc.RpcMethodHandler (its stubs are not generic enough to say more)
Parse = Callable[[bytes], Any]


def malformed_message(type_name: str, size: int) -> str:
    return f"request body is not a valid encoding of {type_name} ({size} bytes)"


@dataclass
class Wire:
    """Registers servicers on a grpc.aio server so their calls parse their own bodies.

    `register` is a generated `add_<Service>Servicer_to_server` function."""

    request_idle_s: float = DEFAULT_REQUEST_IDLE_S
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES
    on_malformed: MalformedHook | None = None

    def add(self, server: Any, register: Callable[[Any, Any], None], servicer: Any) -> None:
        """`server`: a grpc.aio server, or anything with its two registration methods."""
        capture = _Capture()
        register(servicer, capture)
        for service, handlers in capture.services.items():
            guarded = {
                name: self.guard(f"/{service}/{name}", handler)
                for name, handler in handlers.items()
            }
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler(service, guarded),)
            )
            # (grpc-stubs predate registered methods)
            server.add_registered_method_handlers(service, guarded)

    def add_reflection(self, server: Any, services: Sequence[str]) -> None:
        """Server reflection (for grpcurl) of `services` and itself."""
        servicer = reflection.aio.ReflectionServicer(  # type: ignore[attr-defined]
            (*services, reflection.SERVICE_NAME)
        )
        self.add(server, reflection_pb2_grpc.add_ServerReflectionServicer_to_server, servicer)

    def guard(self, method: str, handler: Handler) -> Handler:
        """`handler` with its request parsed in the call (and its wait bounded)."""
        parse: Parse | None = handler.request_deserializer
        if parse is None:
            return handler
        type_name = _type_name(parse)
        serializer = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary_unary(method, type_name, parse, handler.unary_unary),
                response_serializer=serializer,
            )
        if handler.unary_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._unary_stream(method, type_name, parse, handler.unary_stream),
                response_serializer=serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._stream_request(method, type_name, parse, handler.stream_unary),
                response_serializer=serializer,
            )
        return grpc.stream_stream_rpc_method_handler(
            self._stream_request(method, type_name, parse, handler.stream_stream),
            response_serializer=serializer,
        )

    # A unary request is read here, not by grpc before the handler, so the wait for it is
    # bounded; the handler is registered as a request stream of which one message is read.

    def _unary_unary(self, method: str, type_name: str, parse: Parse, inner: Any) -> Any:
        async def call(_requests: object, context: Any) -> Any:
            await self._check_metadata(method, context)
            request = await self._first(method, type_name, parse, context)
            answer = inner(request, context)
            return (await answer) if inspect.isawaitable(answer) else answer

        return call

    def _unary_stream(self, method: str, type_name: str, parse: Parse, inner: Any) -> Any:
        generates = inspect.isasyncgenfunction(inner)  # else it writes its own

        async def call(_requests: object, context: Any) -> None:
            await self._check_metadata(method, context)
            request = await self._first(method, type_name, parse, context)
            if generates:
                await _write_all(inner(request, context), context)
            else:
                await inner(request, context)

        return call

    def _stream_request(self, method: str, type_name: str, parse: Parse, inner: Any) -> Any:
        generates = inspect.isasyncgenfunction(inner)

        async def requests(
            raw_requests: AsyncIterator[bytes], context: Any
        ) -> AsyncGenerator[Any, None]:
            async for raw in raw_requests:
                try:
                    request = parse(raw)
                except DecodeError:
                    await self._refuse(method, type_name, raw, context)
                yield request

        async def call(raw_requests: AsyncIterator[bytes], context: Any) -> Any:
            await self._check_metadata(method, context)
            parsed = requests(raw_requests, context)
            async with contextlib.aclosing(parsed):
                if generates:
                    await _write_all(inner(parsed, context), context)
                    return None
                return await inner(parsed, context)

        return call

    async def _check_metadata(self, method: str, context: Any) -> None:
        size = sum(len(k) + len(v) + 32 for k, v in context.invocation_metadata() or ())
        if size > self.max_metadata_bytes:
            log.info("metadata over the limit", method=method, peer=context.peer(), bytes=size)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request metadata is {size} bytes, over the limit of "
                f"{self.max_metadata_bytes} bytes",
            )

    async def _first(
        self,
        method: str,
        type_name: str,
        parse: Parse,
        context: Any,
    ) -> Any:
        # context.read(), not the iterator: an async generator left unfinished would cost
        # the event loop a task to close it.
        try:
            async with asyncio.timeout(self.request_idle_s):
                raw = await context.read()
        except TimeoutError:
            log.info("request never arrived", method=method, peer=context.peer())
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no {type_name} arrived within {self.request_idle_s:g} s of the call "
                "starting (the server's request idle limit)",
            )
        if raw is grpc.aio.EOF:  # type: ignore[attr-defined]  # the client closed its side without a request
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"the call ended before its {type_name}"
            )
        try:
            return parse(raw)
        except DecodeError:
            await self._refuse(method, type_name, raw, context)

    async def _refuse(self, method: str, type_name: str, raw: bytes, context: Any) -> NoReturn:
        message = malformed_message(type_name, len(raw))
        log.info("malformed request", method=method, peer=context.peer(), bytes=len(raw))
        if self.on_malformed is not None:
            self.on_malformed(method)
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            message,
            trailing_metadata=status_trailers(
                grpc.StatusCode.INVALID_ARGUMENT,
                message,
                violations=[FieldViolation("request", message)],
            ),
        )
        raise AssertionError("abort returned")


async def _write_all(responses: AsyncGenerator[Any, None], context: Any) -> None:
    """Write a generating handler's messages, closing it at once if the call ends early."""
    async with contextlib.aclosing(responses):
        async for response in responses:
            await context.write(response)


def _type_name(parse: Parse) -> str:
    """The full protobuf name of the message a generated `FromString` parses."""
    owner = getattr(parse, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return str(getattr(descriptor, "full_name", "the request message"))


class _Capture:
    """Stands in for a server while a generated `add_*_to_server` registers a servicer:
    keeps its method handlers, by service."""

    def __init__(self) -> None:
        self.services: dict[str, dict[str, Handler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the same handlers come to add_registered_method_handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Handler]) -> None:
        self.services[service] = dict(handlers)
