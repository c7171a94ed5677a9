"""What the sync and asyncio clients share: building requests, metadata, channels and
the retry policy."""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from switchyard.v1 import admin_pb2, common_pb2, generation_pb2

from switchyard.client.errors import SwitchyardError
from switchyard.client.types import Final

Metadata = list[tuple[str, str]]
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of a call that failed before its first token with UNAVAILABLE, or with
    RESOURCE_EXHAUSTED and the server's RetryInfo: after that delay when the server gave
    one, else after an exponential backoff; both jittered, within the call's deadline."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    retry_on: frozenset[grpc.StatusCode] = frozenset(
        {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}
    )
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, err: SwitchyardError, attempt: int, deadline: float | None) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up."""
        if err.code not in self.retry_on or attempt + 1 >= self.max_attempts:
            return None
        if err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after_s is None:
            return None  # not a busy server (one says when to come back): a size limit, say
        if err.retry_after_s is not None:
            wait = err.retry_after_s * self.rng.uniform(1.0, 1.25)
        else:
            backoff = min(self.max_backoff_s, self.initial_backoff_s * 2**attempt)
            wait = backoff * self.rng.uniform(0.5, 1.5)
        if deadline is not None and time.monotonic() + wait >= deadline:
            return None
        return wait


NO_RETRY = RetryPolicy(max_attempts=1)


@dataclass(frozen=True, slots=True)
class Tls:
    """TLS to the server: `ca` to trust (default: the system's roots); `cert` and `key`
    for mutual TLS. Paths to PEM files, or the PEM bytes."""

    ca: str | Path | bytes | None = None
    cert: str | Path | bytes | None = None
    key: str | Path | bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_pem(self.ca),
            private_key=_pem(self.key),
            certificate_chain=_pem(self.cert),
        )


def _pem(value: str | Path | bytes | None) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def metadata(
    token: str | None, traceparent: str | None, extra: Sequence[tuple[str, str]] = ()
) -> Metadata:
    md: Metadata = []
    if token:
        md.append(("authorization", f"Bearer {token}"))
    if traceparent:
        md.append(("traceparent", traceparent))
    md.extend(extra)
    return md


Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]


def generate_request(
    model: str,
    prompt: Prompt,
    *,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool | None = None,
    include_stop: bool | None = None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    skip_special_tokens: bool | None = None,
    request_id: str | None = None,
    priority: int = 0,
    n: int = 1,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    seed: int | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
    json_object: bool = False,
    regex: str | None = None,
    choice: Sequence[str] | None = None,
    grammar: str | None = None,
    adapter: str = "",
    beam_width: int = 0,
) -> generation_pb2.GenerateRequest:
    """A `GenerateRequest`: `prompt` is text, token ids, or a conversation
    (`[{"role": "user", "content": "Hi"}]`, rendered by the model's chat template on the
    server). Structured output: at most one of `json_schema` (a dict or JSON text),
    `json_object`, `regex`, `choice`, `grammar`. `adapter` names a LoRA adapter loaded
    on the model (`load_adapter`). `beam_width` > 1 asks for beam search: the beams come
    back as the choices, best first. Unset values take the server's defaults.
    The request id is fixed here, so that retries keep it."""
    sampling = common_pb2.SamplingParams()
    values = locals()
    for name in _SAMPLING:
        if values[name] is not None:
            setattr(sampling, name, values[name])
    stopping = generation_pb2.StoppingParams(stop=list(stop), stop_token_ids=list(stop_token_ids))
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    if min_tokens is not None:
        stopping.min_tokens = min_tokens
    if ignore_eos is not None:
        stopping.ignore_eos = ignore_eos
    if include_stop is not None:
        stopping.include_stop_str_in_output = include_stop
    output = generation_pb2.OutputOptions()
    if logprobs is not None:
        output.logprobs = logprobs
    if prompt_logprobs is not None:
        output.prompt_logprobs = prompt_logprobs
    if skip_special_tokens is not None:
        output.skip_special_tokens = skip_special_tokens
    req = generation_pb2.GenerateRequest(
        model=model,
        sampling=sampling,
        stopping=stopping,
        output=output,
        request_id=request_id or uuid.uuid4().hex,
        priority=priority,
        n=n,
        adapter=adapter,
        beam_width=beam_width,
    )
    _constrain(req, json_schema, json_object, regex, choice, grammar)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], Mapping):
        for turn in prompt:
            assert isinstance(turn, Mapping)
            req.messages.messages.add(role=turn["role"], content=turn["content"])
    else:
        req.token_ids.ids.extend(int(t) for t in prompt)  # type: ignore[arg-type]
    return req


def _constrain(
    req: generation_pb2.GenerateRequest,
    json_schema: Mapping[str, Any] | str | None,
    json_object: bool,
    regex: str | None,
    choice: Sequence[str] | None,
    grammar: str | None,
) -> None:
    given = {
        "json_schema": json_schema,
        "json_object": json_object or None,
        "regex": regex,
        "choice": choice,
        "grammar": grammar,
    }
    kinds = [name for name, value in given.items() if value is not None]
    if len(kinds) > 1:
        raise ValueError(f"give one structured-output constraint, not {' and '.join(kinds)}")
    if not kinds:
        return
    c = req.constraint
    if json_schema is not None:
        c.json_schema = json_schema if isinstance(json_schema, str) else json.dumps(json_schema)
    elif json_object:
        c.json_object = True
    elif regex is not None:
        c.regex = regex
    elif choice is not None:
        c.choice.values.extend(choice)
    elif grammar is not None:
        c.grammar = grammar


def deadline_of(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]


def tokenize_request(
    model: str, text: str, add_special_tokens: bool
) -> generation_pb2.TokenizeRequest:
    return generation_pb2.TokenizeRequest(
        model=model, text=text, add_special_tokens=add_special_tokens
    )


def unload_request(name: str, grace_s: float | None) -> admin_pb2.UnloadModelRequest:
    req = admin_pb2.UnloadModelRequest(name=name)
    if grace_s is not None:
        req.grace_s = grace_s
    return req


def unload_adapter_request(
    model: str, name: str, grace_s: float | None
) -> admin_pb2.UnloadAdapterRequest:
    req = admin_pb2.UnloadAdapterRequest(model=model, name=name)
    if grace_s is not None:
        req.grace_s = grace_s
    return req


def drain_request(address: str, grace_s: float | None) -> admin_pb2.DrainWorkerRequest:
    req = admin_pb2.DrainWorkerRequest(address=address)
    if grace_s is not None:
        req.grace_s = grace_s
    return req


class Outcome:
    """Where a stream's generator leaves its Finals: not the stream itself, since a
    generator holding its stream would make a cycle, and a stream dropped mid-way would
    cancel its call only when the garbage collector came by."""

    __slots__ = ("ended", "finals", "samples")

    def __init__(self, samples: int = 1) -> None:
        self.samples = samples
        self.finals: list[Final] = []  # one per sample, as they end
        self.ended = False  # every sample's Final came

    def add(self, final: Final) -> None:
        self.finals.append(final)
        if final.cumulative_logprob is not None:  # a beam: the last one carries total_usage
            self.ended = final.total_usage is not None
        else:
            self.ended = len(self.finals) >= self.samples


class Finals:
    """A stream's `final` and `finals`, read from its Outcome."""

    _outcome: Outcome

    @property
    def final(self) -> Final | None:
        """The last Final (with n > 1 the one that carries total_usage)."""
        finals = self._outcome.finals
        return finals[-1] if finals else None

    @property
    def finals(self) -> list[Final]:
        """Every sample's Final (n > 1), in the order they ended."""
        return list(self._outcome.finals)
