"""A request's prompt as token ids: given, rendered from a conversation with the model's
chat template, or encoded; long ones in a thread, so that the event loop keeps serving
every other stream meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from control.fleet.models import ModelEntry
from control.text.params import GenerationParams
from control.text.tokenizer import Tokenizer

# Prompts longer than this are tokenized in a thread, off the event loop.
TOKENIZE_INLINE_MAX_CHARS = 4096


async def encode_prompt(
    tokenizer: Tokenizer, text: str, add_special_tokens: bool = True
) -> list[int]:
    """Token ids of `text`; a long prompt is tokenized in a thread so that the event loop
    keeps serving every other stream meanwhile."""
    if len(text) <= TOKENIZE_INLINE_MAX_CHARS:
        return tokenizer.encode(text, add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


async def encode_chat(entry: ModelEntry, messages: Sequence[tuple[str, str]]) -> list[int]:
    """A conversation's prompt ids: rendered with the model's chat template (the template
    writes the special tokens it wants, so the tokenizer adds none)."""
    tokenizer = entry.tokenizer

    def render_and_encode() -> list[int]:
        text = tokenizer.render_chat(messages, entry.spec.chat_template, entry.name)
        return tokenizer.encode(text, False)

    if sum(len(content) for _, content in messages) <= TOKENIZE_INLINE_MAX_CHARS:
        return render_and_encode()
    return await asyncio.to_thread(render_and_encode)


async def prompt_ids_of(entry: ModelEntry, params: GenerationParams) -> list[int]:
    """The request's prompt as token ids: given, rendered from a conversation, or encoded."""
    if params.prompt_ids is not None:
        return list(params.prompt_ids)
    if params.messages is not None:
        return await encode_chat(entry, params.messages)
    assert params.prompt_text is not None
    return await encode_prompt(entry.tokenizer, params.prompt_text)
