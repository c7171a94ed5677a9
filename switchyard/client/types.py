"""What the client returns: plain typed values, not protobuf messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from switchyard.v1 import common_pb2

__all__ = ["Chunk", "Completion", "Final", "ModelInfo", "Timing", "TokenLogprob", "Usage"]

_REASONS = {
    v.number: v.name.removeprefix("FINISH_REASON_").lower()
    for v in common_pb2.DESCRIPTOR.enum_types_by_name["FinishReason"].values
}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, token text, logprob)


@dataclass(frozen=True, slots=True)
class Chunk:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    # The first chunk's, when prompt_logprobs was asked: each prompt token after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0  # which sample (n > 1)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Timing:
    queue_ms: float
    time_to_first_token_ms: float
    total_ms: float


@dataclass(frozen=True, slots=True)
class Final:
    finish_reason: str  # length | stop | cancelled | time_limit | error
    usage: Usage
    timing: Timing
    worker: str
    engine: str
    request_id: str
    eos_token_id: int | None = None
    stop_token_id: int | None = None
    stop_string: str | None = None
    error_message: str = ""
    index: int = 0  # which sample this ends (n > 1)
    total_usage: Usage | None = None  # the last Final of n > 1: all samples, prompt once
    adapter: str = ""  # the LoRA adapter that served it
    cumulative_logprob: float | None = None  # beam search: the beam's total log probability
    # Mid-stream failover: the token counts at which another worker took the stream over.
    resumed_after_tokens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]
    final: Final
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    choices: tuple[Choice, ...] = ()  # n > 1 or beams: every one, in index order


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    text: str
    token_ids: tuple[int, ...]
    final: Final
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    engine: str
    max_context: int
    vocab_size: int
    healthy_workers: int
    workers: int


@dataclass(slots=True)
class Tokens:
    token_ids: list[int] = field(default_factory=list)
    tokens: list[str] = field(default_factory=list)


def logprobs_of(msgs: Any) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(
            lp.token_id, lp.logprob, tuple((t.token_id, t.token, t.logprob) for t in lp.top)
        )
        for lp in msgs
    )


def chunk_of(msg: Any) -> Chunk:
    return Chunk(
        msg.text,
        tuple(msg.token_ids),
        logprobs_of(msg.logprobs),
        logprobs_of(msg.prompt_logprobs),
        msg.index,
    )


def _usage(msg: Any) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_prompt_tokens)


def final_of(msg: Any) -> Final:
    which = msg.WhichOneof("stop_reason")
    return Final(
        finish_reason=_REASONS.get(msg.finish_reason, "unspecified"),
        usage=_usage(msg.usage),
        timing=Timing(msg.timing.queue_ms, msg.timing.time_to_first_token_ms, msg.timing.total_ms),
        worker=msg.worker,
        engine=msg.engine,
        request_id=msg.request_id,
        eos_token_id=msg.eos_token_id if which == "eos_token_id" else None,
        stop_token_id=msg.stop_token_id if which == "stop_token_id" else None,
        stop_string=msg.stop_string if which == "stop_string" else None,
        error_message=msg.error_message,
        index=msg.index,
        total_usage=_usage(msg.total_usage) if msg.HasField("total_usage") else None,
        adapter=msg.adapter,
        cumulative_logprob=(msg.cumulative_logprob if msg.HasField("cumulative_logprob") else None),
        resumed_after_tokens=tuple(msg.resumed_after_tokens),
    )


def model_of(msg: Any) -> ModelInfo:
    return ModelInfo(
        msg.name, msg.engine, msg.max_context, msg.vocab_size, msg.healthy_workers, msg.workers
    )


def completion_of(msg: Any) -> Completion:
    """A CompleteResponse, typed."""
    return Completion(
        msg.text,
        tuple(msg.token_ids),
        final_of(msg.final),
        logprobs_of(msg.logprobs),
        logprobs_of(msg.prompt_logprobs),
        tuple(
            Choice(c.index, c.text, tuple(c.token_ids), final_of(c.final), logprobs_of(c.logprobs))
            for c in msg.choices
        ),
    )


def tokens_of(msg: Any) -> Tokens:
    return Tokens(list(msg.token_ids), list(msg.tokens))
