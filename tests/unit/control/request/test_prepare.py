"""A request prepared once (control/request/prepare.py): checked against its model,
tokenized, bound to the context; samples made from it without preparing again."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from switchyard.v1 import generation_pb2

from control.errors import FailedPrecondition, InvalidArgument
from control.request.prepare import PreparedRequest, prepare
from control.text.params import ModelLimits, parse_request
from control.text.tokenizer import Tokenizer
from control.workers.state import Capabilities


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(str(tiny_model_dir))


def entry(tok: Tokenizer, max_context: int = 64, caps: Capabilities | None = None) -> Any:
    return SimpleNamespace(
        name="m",
        tokenizer=tok,
        limits=ModelLimits(max_context=max_context, vocab_size=tok.vocab_size),
        info=SimpleNamespace(capabilities=caps, label="sim 1"),
        spec=SimpleNamespace(chat_template=None),
        adapters={},
        adapter_names=lambda: [],
        refresh=None,
    )


async def ready(tok: Tokenizer, e: Any | None = None, **fields: Any) -> PreparedRequest:
    params = parse_request(generation_pb2.GenerateRequest(model="m", **fields))
    return await prepare(e or entry(tok), params, 0.0, 5.0)


async def test_a_text_prompt_is_tokenized_and_bound_to_the_context(tok: Tokenizer) -> None:
    p = await ready(tok, text="Hello world")
    assert p.prompt_ids == tuple(tok.encode("Hello world"))
    assert p.max_tokens == 64 - len(p.prompt_ids)  # no max_tokens: the rest of the context
    assert p.deadline is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 1  # type: ignore[misc]


async def test_what_the_model_cannot_hold_names_the_field(tok: Tokenizer) -> None:
    with pytest.raises(InvalidArgument) as err:
        await ready(tok, text="Hello world", stopping={"max_tokens": 1000})
    assert [v.field for v in err.value.violations] == ["stopping.max_tokens"]
    with pytest.raises(InvalidArgument) as err:
        await ready(tok, entry(tok, max_context=3), text="Hello world and more")
    assert [v.field for v in err.value.violations] == ["text"]


async def test_what_the_engine_cannot_do_is_refused_before_tokenizing(tok: Tokenizer) -> None:
    no_logprobs = entry(tok, caps=Capabilities(max_logprobs=0))
    with pytest.raises(FailedPrecondition, match=r"output\.logprobs"):
        await ready(tok, no_logprobs, text="Hi", output={"logprobs": 3})


async def test_samples_share_the_prompt_and_differ_in_seed_and_id(tok: Tokenizer) -> None:
    p = await ready(
        tok, text="Hi", n=3, sampling={"seed": 2**64 - 1}, output={"prompt_logprobs": 1}
    )
    s0, s2 = p.sample(0), p.sample(2)
    assert s0.prompt_ids is p.prompt_ids is s2.prompt_ids  # tokenized once
    assert (s0.params.sampling.seed, s2.params.sampling.seed) == (2**64 - 1, 1)
    assert (s0.params.request_id, s2.params.request_id) == (
        f"{p.params.request_id}-0",
        f"{p.params.request_id}-2",
    )
    assert s0.params.prompt_logprobs == 1 and s2.params.prompt_logprobs is None
    assert s0.params.n == s2.params.n == 1 and s2.max_tokens == p.max_tokens
