"""Incremental detokenization on a real SentencePiece vocabulary (Mistral-7B-v0.1's:
byte-fallback tokens, `▁` word marks, a decoder that strips the first space).

What a client sees streamed must be exactly the text of decoding the whole output after
the prompt, however the tokens are split into chunks: random outputs over the whole
vocabulary and over its byte tokens, after prompts with CJK, emoji, combining and control
characters, and with stop strings cut where the whole text has them.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from switchyard.v1 import generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.request.output import OutputState
from control.text.params import parse_request
from control.text.tokenizer import Tokenizer
from tests.sentencepiece_model import PROMPTS, ensure_sentencepiece_model

BYTE_IDS = range(3, 259)  # <0x00> .. <0xFF> in this vocabulary
SPECIAL_IDS = (0, 1, 2)  # <unk> <s> </s>
VOCAB = 32000


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(str(ensure_sentencepiece_model()))


def whole_text(tok: Tokenizer, prompt: Sequence[int], out: Sequence[int], skip: bool) -> str:
    """The output's text as decoding prompt and output together gives it."""
    return tok.decode([*prompt, *out], skip)[len(tok.decode(prompt, skip)) :]


def streamed(
    tok: Tokenizer, prompt: Sequence[int], out: Sequence[int], sizes: Sequence[int], skip: bool
) -> list[str]:
    detok = tok.detokenizer(prompt[-5:], skip)
    chunks, i = [], 0
    for n in sizes:
        if i >= len(out):
            break
        chunks.append(detok.push(out[i : i + n]))
        i += n
    if i < len(out):
        chunks.append(detok.push(out[i:]))
    chunks.append(detok.flush())
    assert detok.text == "".join(chunks)
    return chunks


def test_the_vocabulary_is_byte_fallback_sentencepiece(tok: Tokenizer) -> None:
    assert tok.vocab_size == VOCAB
    assert tok.vocabulary.byte_ids == frozenset(BYTE_IDS)
    assert tok.tokens([3, 259 + 1]) == ["<0x00>", tok.tokens([260])[0]]
    assert tok.tokens(tok.encode("日本", False))[0].startswith("▁")


@pytest.mark.parametrize("text", PROMPTS)
def test_encoded_text_streams_back_exactly(tok: Tokenizer, text: str) -> None:
    prompt = tok.encode("Say:", True)
    out = tok.encode(text, False)
    chunks = streamed(tok, prompt, out, [1] * len(out), True)
    assert "".join(chunks) == whole_text(tok, prompt, out, True)
    assert "\ufffd" not in "".join(chunks)


ids_anywhere = st.integers(0, VOCAB - 1)
byte_heavy = st.one_of(st.sampled_from(BYTE_IDS), st.sampled_from(BYTE_IDS), ids_anywhere)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.sampled_from(PROMPTS),
    out=st.lists(st.one_of(ids_anywhere, byte_heavy, st.sampled_from(SPECIAL_IDS)), max_size=80),
    sizes=st.lists(st.integers(1, 7), min_size=1, max_size=80),
    skip=st.booleans(),
)
def test_random_outputs_stream_as_the_whole_decode(
    tok: Tokenizer, prompt: str, out: list[int], sizes: list[int], skip: bool
) -> None:
    prompt_ids = tok.encode(prompt, True)
    assert "".join(streamed(tok, prompt_ids, out, sizes, skip)) == whole_text(
        tok, prompt_ids, out, skip
    )


def test_a_run_of_bytes_is_held_until_it_ends(tok: Tokenizer) -> None:
    """'日' is <0xE6><0x97><0xA5>; a stray <0x80> after it turns the whole run into
    U+FFFDs in a whole decode, so nothing of the run may be streamed before it ends."""
    prompt = tok.encode("x", True)
    detok = tok.detokenizer(prompt, True)
    run = [3 + 0xE6, 3 + 0x97, 3 + 0xA5]
    assert [detok.push([t]) for t in run] == ["", "", ""]
    assert detok.push([3 + 0x80]) == ""
    word = tok.encode("word", False)
    text = detok.push(word) + detok.flush()
    assert text == whole_text(tok, prompt, [*run, 3 + 0x80, *word], True)
    assert text.startswith("\ufffd" * 4)


def test_skipped_special_tokens_do_not_cost_a_word_its_space(tok: Tokenizer) -> None:
    """Many skipped special tokens in a row, then a word: its leading space stays."""
    prompt = tok.encode("one", True)
    out = [*tok.encode("two", False), *([2, 0, 1] * 10), *tok.encode("three four", False)]
    assert "".join(streamed(tok, prompt, out, [1] * len(out), True)) == " two three four"


@settings(max_examples=60, deadline=None)
@given(
    out=st.lists(st.one_of(ids_anywhere, byte_heavy), min_size=8, max_size=60),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=60),
    data=st.data(),
)
def test_stop_strings_cut_exactly_where_the_whole_text_has_them(
    tok: Tokenizer, out: list[int], sizes: list[int], data: st.DataObject
) -> None:
    prompt = tok.encode(PROMPTS[0], True)
    full = whole_text(tok, prompt, out, True)
    visible = full.replace("\ufffd", "")
    if len(visible) < 4:
        return
    start = data.draw(st.integers(0, len(full) - 2))
    stop = full[start : start + data.draw(st.integers(1, 3))]
    if "\ufffd" in stop or not stop.strip():
        return
    request = generation_pb2.GenerateRequest(model="m", text=PROMPTS[0])
    request.stopping.stop.append(stop)
    params = parse_request(request)
    state = OutputState(tok, params, prompt, [2], generation_pb2.Final(), lambda n: None)
    text, i = [], 0
    for n in [*sizes, len(out)]:
        if i >= len(out) or state.stopped:
            break
        text.append(state.push(worker_pb2.Chunk(token_ids=out[i : i + n])).chunk.text)
        i += n
    tail = state.flush()
    if tail is not None:
        text.append(tail.chunk.text)
    assert state.final.stop_string == stop
    assert "".join(text) == full[: full.index(stop)]
    # The answer's tokens are the output's first ones, through the stop string.
    kept = state.generated
    assert kept == out[: len(kept)]
    assert stop in whole_text(tok, prompt, kept, True)
