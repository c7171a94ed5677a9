"""The blocking client.

```python
from switchyard.client import Client

with Client("127.0.0.1:50051") as client:
    stream = client.generate("tiny", "Hello", max_tokens=16)
    for chunk in stream:
        print(chunk.text, end="")
    print(stream.final.usage)
```

A stream closed (`close()`, the end of a `with` block) or dropped (a `break` out of a
loop over it, with no other reference left) cancels its call: the server aborts the
engine request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, TypeVar

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
from switchyard.client.errors import SwitchyardError, from_rpc_error
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

T = TypeVar("T")


class Stream(Finals):
    """The chunks of one generation, as they come; `final` once it has ended. Dropping
    it, or `close()`, cancels a generation still running."""

    def __init__(
        self,
        start: Callable[[float | None], Any],
        deadline: float | None,
        retry: RetryPolicy,
        samples: int = 1,
    ) -> None:
        self._outcome = Outcome(samples)
        self._chunks = _run(start, deadline, retry, self._outcome)

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; a generation still running is cancelled."""
        self._chunks.close()


def _first(
    start: Callable[[float | None], Any], deadline: float | None, retry: RetryPolicy
) -> tuple[Any, Any]:
    """The call and its first message, retried as the policy says before it."""
    attempt = 0
    while True:
        call = start(remaining(deadline))
        try:
            return call, next(call)
        except StopIteration:
            return call, None
        except grpc.RpcError as e:
            err = from_rpc_error(e)
            wait = retry.delay(err, attempt, deadline)
            if wait is None:
                raise err from None
            time.sleep(wait)
            attempt += 1


def _run(
    start: Callable[[float | None], Any],
    deadline: float | None,
    retry: RetryPolicy,
    outcome: Outcome,
) -> Generator[Chunk, None, None]:
    call, msg = _first(start, deadline, retry)
    try:
        while msg is not None:
            if msg.HasField("final"):
                outcome.add(final_of(msg.final))
            else:
                yield chunk_of(msg.chunk)
            msg = next(call, None)
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    finally:
        if not outcome.ended:  # dropped or failed before the end: stop every sample
            call.cancel()


class Client:
    """One connection to a Switchyard control plane: `Generation` and `Admin`.

    `token` goes as `authorization: Bearer`; `tls` (a `Tls`, or True for the system's
    roots) makes the channel secure; `timeout` is each call's deadline unless the call
    gives its own; `retry` applies before a generation's first token.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: Tls | bool = False,
        timeout: float | None = 60.0,
        retry: RetryPolicy | None = None,
        channel: grpc.Channel | None = None,
    ) -> None:
        self.address = address
        self.token = token
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        if channel is None:
            if tls:
                creds = (tls if isinstance(tls, Tls) else Tls()).credentials()
                channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
            else:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.channel = channel
        self._gen = generation_pb2_grpc.GenerationStub(channel)
        self._admin = admin_pb2_grpc.AdminStub(channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _md(self, traceparent: str | None, extra: Sequence[tuple[str, str]]) -> Metadata:
        return metadata(self.token, traceparent, extra)

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _unary(
        self,
        method: Callable[..., T],
        request: Any,
        timeout: float | None,
        traceparent: str | None = None,
        md: Sequence[tuple[str, str]] = (),
    ) -> T:
        try:
            return method(
                request, timeout=self._timeout(timeout), metadata=self._md(traceparent, md)
            )
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # ---- Generation ---------------------------------------------------------------

    def generate(
        self,
        model: str,
        prompt: Prompt,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        **options: Any,
    ) -> Stream:
        """Stream a generation. `options` are `generate_request`'s: max_tokens,
        temperature, top_p, seed, stop, ignore_eos, logprobs, request_id, ..."""
        req = generate_request(model, prompt, **options)
        md = self._md(traceparent, metadata)

        def start(left: float | None) -> Any:
            return self._gen.Generate(req, timeout=left, metadata=md)

        return Stream(start, deadline_of(self._timeout(timeout)), self.retry, req.n or 1)

    def complete(
        self,
        model: str,
        prompt: Prompt,
        *,
        timeout: float | None = None,
        traceparent: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        **options: Any,
    ) -> Completion:
        """The whole generation at once (retried like `generate`)."""
        req = generate_request(model, prompt, **options)
        md = self._md(traceparent, metadata)
        deadline = deadline_of(self._timeout(timeout))
        attempt = 0
        while True:
            try:
                out = self._gen.Complete(req, timeout=remaining(deadline), metadata=md)
                return completion_of(out)
            except grpc.RpcError as e:
                err: SwitchyardError = from_rpc_error(e)
                wait = self.retry.delay(err, attempt, deadline)
                if wait is None:
                    raise err from None
                time.sleep(wait)
                attempt += 1

    def tokenize(
        self,
        model: str,
        text: str,
        *,
        add_special_tokens: bool = True,
        timeout: float | None = None,
    ) -> Tokens:
        req = tokenize_request(model, text, add_special_tokens)
        out = self._unary(self._gen.Tokenize, req, timeout)
        return tokens_of(out)

    def models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        out = self._unary(self._gen.ListModels, generation_pb2.ListModelsRequest(), timeout)
        return [model_of(m) for m in out.models]

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> str:
        """grpc.health.v1's status of `service` ("": the server): SERVING, NOT_SERVING,
        ... (NotFound for a service it does not know)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.channel)
        out = self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(out.status))

    # ---- Admin --------------------------------------------------------------------

    def workers(self, model: str = "", *, timeout: float | None = None) -> list[Any]:
        """`switchyard.v1.WorkerStatus` of every worker (of `model`, if given)."""
        out = self._unary(
            self._admin.ListWorkers, admin_pb2.ListWorkersRequest(model=model), timeout
        )
        return list(out.workers)

    def load_model(self, spec: admin_pb2.ModelSpec, *, timeout: float | None = 600.0) -> Any:
        """Start (or join) a model's workers; returns `LoadModelResponse` once it serves."""
        return self._unary(self._admin.LoadModel, admin_pb2.LoadModelRequest(spec=spec), timeout)

    def unload_model(
        self, name: str, *, grace_s: float | None = None, timeout: float | None = 600.0
    ) -> Any:
        req = unload_request(name, grace_s)
        return self._unary(self._admin.UnloadModel, req, timeout)

    def load_adapter(
        self, model: str, name: str, path: str, *, timeout: float | None = 600.0
    ) -> Any:
        """Load a LoRA adapter (a directory every worker of the model can read) on every
        worker of `model`; requests then name it (`adapter=`)."""
        req = admin_pb2.LoadAdapterRequest(model=model, name=name, path=path)
        return self._unary(self._admin.LoadAdapter, req, timeout)

    def unload_adapter(
        self,
        model: str,
        name: str,
        *,
        grace_s: float | None = None,
        timeout: float | None = 600.0,
    ) -> Any:
        """Stop new requests for it; wait up to `grace_s` for those in flight."""
        req = unload_adapter_request(model, name, grace_s)
        return self._unary(self._admin.UnloadAdapter, req, timeout)

    def adapters(self, model: str = "", *, timeout: float | None = None) -> list[Any]:
        req = admin_pb2.ListAdaptersRequest(model=model)
        return list((self._unary(self._admin.ListAdapters, req, timeout)).adapters)

    def drain(
        self, address: str, *, grace_s: float | None = None, timeout: float | None = 600.0
    ) -> Any:
        req = drain_request(address, grace_s)
        return self._unary(self._admin.DrainWorker, req, timeout)
