"""A request's output state (control/request/output.py) with plain token ids: no server,
no worker. What the client would see of the chunks a worker sends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from switchyard.v1 import common_pb2, generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.request.output import COUNT_EVERY_TOKENS, OutputState
from control.text.params import parse_request
from control.text.tokenizer import Tokenizer

STOP = common_pb2.FINISH_REASON_STOP


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(str(tiny_model_dir))


class Counter:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def state(
    tok: Tokenizer, counter: Counter | None = None, prompt: str = "Hi", **fields: Any
) -> OutputState:
    params = parse_request(generation_pb2.GenerateRequest(model="m", text=prompt, **fields))
    prompt_ids = tok.encode(prompt)
    final = generation_pb2.Final()
    final.usage.prompt_tokens = len(prompt_ids)
    return OutputState(tok, params, prompt_ids, [1], final, counter or Counter())


def chunk(*ids: int, logprobs: list[common_pb2.TokenLogprob] | None = None) -> worker_pb2.Chunk:
    return worker_pb2.Chunk(token_ids=ids, logprobs=logprobs or [])


def run(out: OutputState, chunks: list[worker_pb2.Chunk]) -> tuple[str, list[int]]:
    """What the client sees: the text and the ids of every public chunk, tail included."""
    text, ids = "", []
    for c in chunks:
        public = out.push(c).chunk
        text += public.text
        ids += public.token_ids
        if out.stopped:
            break
    tail = out.flush()
    if tail is not None:
        text += tail.chunk.text
    return text, ids


def test_chunks_become_text_and_the_final_counts_them(tok: Tokenizer) -> None:
    ids = tok.encode(" Hello world. The end", False)
    out = state(tok)
    text, sent = run(out, [chunk(*ids[:2]), chunk(*ids[2:])])
    assert text == " Hello world. The end"
    assert sent == ids == out.generated
    assert out.final.usage.completion_tokens == len(ids)
    assert not out.stopped and out.final.finish_reason == 0  # the worker's Final says why


def test_a_stop_string_cuts_the_text_and_the_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(" Hello world. Stop here and more text", False)
    out = state(tok, stopping={"stop": ["here"]})
    text, sent = run(out, [chunk(*ids)])  # one chunk that runs past the stop string
    assert text == " Hello world. Stop "
    assert out.stopped and out.final.stop_string == "here"
    assert out.final.finish_reason == STOP
    assert sent == out.generated and len(sent) < len(ids)  # cut after the completing token
    assert "here" in tok.decode(sent, True) and "and" not in tok.decode(sent, True)
    assert out.final.usage.completion_tokens == len(sent)


def test_include_stop_keeps_the_stop_string(tok: Tokenizer) -> None:
    ids = tok.encode(" one two three", False)
    out = state(tok, stopping={"stop": ["two"], "include_stop_str_in_output": True})
    text, _ = run(out, [chunk(i) for i in ids])
    assert text == " one two"


def test_a_possible_stop_string_is_held_back_until_it_cannot_be_one(tok: Tokenizer) -> None:
    ids = tok.encode(" ab abc", False)
    out = state(tok, stopping={"stop": ["abx"]})
    texts = [out.push(chunk(i)).chunk.text for i in ids]
    assert not texts[-1].endswith("ab")  # " ab" might still become "abx"
    tail = out.flush()
    assert "".join(texts) + (tail.chunk.text if tail else "") == " ab abc"


def test_alternatives_get_their_text_and_prompt_logprobs_go_out_once(tok: Tokenizer) -> None:
    hello, world = tok.encode(" Hello world", False)[:2]
    lp = common_pb2.TokenLogprob(
        token_id=hello, logprob=-0.5, top=[common_pb2.TopLogprob(token_id=world, logprob=-1.0)]
    )
    prompt_lp = [common_pb2.TokenLogprob(token_id=hello, logprob=-2.0)]
    out = state(tok, output={"logprobs": 1, "prompt_logprobs": 0})
    first = out.push(worker_pb2.Chunk(token_ids=[hello], logprobs=[lp], prompt_logprobs=prompt_lp))
    again = out.push(worker_pb2.Chunk(token_ids=[world], prompt_logprobs=prompt_lp))
    assert first.chunk.logprobs[0].top[0].token == tok.decode([world], False)
    assert len(first.chunk.prompt_logprobs) == 1 and not again.chunk.prompt_logprobs


def test_tokens_are_counted_in_batches_and_all_at_the_end(tok: Tokenizer) -> None:
    counter = Counter()
    out = state(tok, counter)
    word = tok.encode(" a", False)[0]
    for _ in range(COUNT_EVERY_TOKENS + 3):
        out.push(chunk(word))
    assert counter.calls == [COUNT_EVERY_TOKENS]
    out.flush()
    assert counter.calls == [COUNT_EVERY_TOKENS, 3]
    out.count()
    assert sum(counter.calls) == COUNT_EVERY_TOKENS + 3  # never twice


def test_a_last_token_that_ends_the_request(tok: Tokenizer) -> None:
    word = tok.encode(" a", False)[0]
    out = state(tok)
    assert not out.ended_by_last_token()  # nothing yet
    out.push(chunk(word, 1))  # EOS (id 1) last: the worker died after it
    assert out.ended_by_last_token()
    assert out.final.eos_token_id == 1 and out.final.finish_reason == STOP
    ignoring = state(tok, stopping={"ignore_eos": True})
    ignoring.push(chunk(word, 1))
    assert not ignoring.ended_by_last_token()
    stop_id = state(tok, stopping={"stop_token_ids": [word]})
    stop_id.push(chunk(7, word))
    assert stop_id.ended_by_last_token() and stop_id.final.stop_token_id == word


def test_the_workers_final_is_taken_with_cached_tokens_capped_at_the_prompt(
    tok: Tokenizer,
) -> None:
    out = state(tok, prompt="Hello there")
    prompt_tokens = out.final.usage.prompt_tokens
    wf = worker_pb2.Final(finish_reason=STOP, eos_token_id=1)
    wf.usage.cached_prompt_tokens = prompt_tokens + 5  # a resumed worker's longer prompt
    out.take_final(wf)
    assert out.final.usage.cached_prompt_tokens == prompt_tokens
    assert out.final.finish_reason == STOP and out.final.eos_token_id == 1
