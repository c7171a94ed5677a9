"""A request made ready once, before anything is admitted or routed.

`parse_request` (control.text.params, at the API's edge) checks what can be checked
without a model. `prepare` checks the rest against the model the request names: what
its engine can do (`check_capabilities`), the adapter it asks for, the prompt tokenized
(given ids, a conversation rendered with the chat template, or text) and bound to the
model's context and vocabulary. What comes out is one frozen `PreparedRequest`: every
later stage reads it and none checks again. Samples (`n > 1`) are made from it without
preparing again.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from control.fleet.models import ModelEntry
from control.request.capabilities import check_adapter, check_capabilities
from control.text.params import GenerationParams


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated, tokenized request of one model: what the pipeline runs."""

    entry: ModelEntry
    params: GenerationParams
    prompt_ids: tuple[int, ...]
    max_tokens: int  # per sequence (per beam), within the model's context
    received_at: float  # time.perf_counter() when the RPC arrived
    deadline: float | None  # time.monotonic() by which it must end; None: no deadline
    # Tokens per streamed chunk: the request's, raised to the server's (api.stream_interval).
    stream_interval: int = 1

    @property
    def most_tokens(self) -> int:
        """The tokens it may generate, every beam's."""
        return self.max_tokens * self.params.beam_width

    def sample(self, i: int) -> PreparedRequest:
        """Sample i of n as a request of its own: seed + i, its own request id toward the
        workers; the prompt's logprobs (the same for every sample) asked of sample 0
        only. The prompt is not tokenized again."""
        params = self.params
        sampling = params.sampling
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + i) % 2**64)
        one = dataclasses.replace(
            params,
            sampling=sampling,
            request_id=f"{params.request_id}-{i}",
            prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            n=1,
        )
        return dataclasses.replace(self, params=one)


async def prompt_ids_of(entry: ModelEntry, params: GenerationParams) -> list[int]:
    """The request's prompt as token ids: given, rendered from a conversation, or encoded."""
    if params.prompt_ids is not None:
        return list(params.prompt_ids)
    tokenizer = entry.tokenizer
    if params.messages is not None:
        return await tokenizer.encode_chat(params.messages, entry.spec.chat_template, entry.name)
    assert params.prompt_text is not None
    return await tokenizer.encode_off_loop(params.prompt_text)


async def prepare(
    entry: ModelEntry,
    params: GenerationParams,
    received_at: float,
    time_remaining: float | None,
    stream_interval: int = 1,
) -> PreparedRequest:
    """Check `params` against `entry`'s model and tokenize its prompt; raises the
    client's error (FAILED_PRECONDITION, INVALID_ARGUMENT, NOT_FOUND) naming the field.
    `stream_interval` is the server's tokens per chunk, the least a request gets."""
    deadline = None if time_remaining is None else time.monotonic() + time_remaining
    check_capabilities(entry, params)
    await check_adapter(entry, params)
    prompt_ids = await prompt_ids_of(entry, params)
    max_tokens = entry.limits.bind(params, prompt_ids)
    return PreparedRequest(
        entry,
        params,
        tuple(prompt_ids),
        max_tokens,
        received_at,
        deadline,
        max(params.stream_interval, stream_interval, 1),
    )
