from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import switchyard_runtime as rt
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from control.text.detokenizer import FORCE_LIMIT, IncrementalDetokenizer
from control.text.tokenizer import Tokenizer
from switchyard_common.tinymodel import ensure_tiny_model

EOS_ID = 1
REPLACEMENT_CHAR = "\ufffd"

SAMPLES = [
    "Emoji travel in several bytes: 🚂 🚃 🚄 ✨ and numbers 0123456789.",
    "日本語のテキストも少しだけ含まれています。こんにちは世界。",
    "Il était une fois un petit modèle qui parlait français: grüße, straße.",
    "🚂🚃🚄✨👩‍👩‍👧 mixed 日本 and àéîõü ñ ç — “quotes” …",
    "no spaces:こんにちは🚂straße🚃end",
]


@pytest.fixture(scope="session")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(str(ensure_tiny_model()))


def encode(tok: Any, text: str) -> list[int]:
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    return ids


def byte_ids(tok: Any, text: str) -> list[int]:
    """One single-byte token per UTF-8 byte of `text` (the byte-level base vocabulary)."""
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    mapped = "".join(piece for piece, _ in level.pre_tokenize_str(text))
    ids: list[int] = tok.convert_tokens_to_ids(list(mapped))
    assert len(ids) == len(text.encode())
    return ids


def stream(detok: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int]) -> list[str]:
    chunks: list[str] = []
    i = 0
    for n in sizes:
        chunks.append(detok.push(ids[i : i + n]))
        i += n
    assert i >= len(ids)
    chunks.append(detok.flush())
    return chunks


class CountingDecoder:
    """Wraps the tokenizer and records how many ids each decode call got."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids: Sequence[int], /, skip_special_tokens: bool) -> str:
        self.sizes.append(len(ids))
        text: str = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


@pytest.mark.parametrize("text", SAMPLES)
def test_one_token_at_a_time(tok: Any, text: str) -> None:
    ids = encode(tok, text)
    assert len(ids) < len(text.encode())  # some merges, so tokens cross characters
    detok = IncrementalDetokenizer(tok)
    chunks = stream(detok, ids, [1] * len(ids))
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)
    assert "".join(chunks) == tok.decode(ids) == text
    assert detok.text == text
    assert chunks[-1] == ""  # nothing was left for flush


def test_multi_token_character_is_held_until_complete(tok: Any) -> None:
    ids = encode(tok, "🚂")
    assert len(ids) == 3
    detok = IncrementalDetokenizer(tok, encode(tok, "Hello"))
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:2]) == ""
    assert detok.push(ids[2:]) == "🚂"
    assert detok.push(encode(tok, " world")) == " world"
    assert detok.text == "🚂 world"


def test_byte_tokens_of_a_cjk_character(tok: Any) -> None:
    ids = byte_ids(tok, "日本")
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([i]) for i in ids] == ["", "", "日", "", "", "本"]


def test_leading_space_with_prompt_context(tok: Any) -> None:
    prompt = encode(tok, "The quick brown fox")
    generated = encode(tok, " jumps over the lazy dog")
    assert tok.decode(generated[:1]).startswith(" ")
    detok = IncrementalDetokenizer(tok, prompt)
    chunks = [detok.push([i]) for i in generated]
    assert chunks[0].startswith(" ")
    assert "".join(chunks) + detok.flush() == " jumps over the lazy dog"
    assert tok.decode(prompt + generated).endswith(detok.text)
    assert "fox" not in detok.text  # the prompt itself is never emitted


def test_prompt_context_with_bos(tok: Any) -> None:
    prompt = tok.encode("Hello, world!")  # starts with BOS
    assert prompt[0] == 0
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        assert detok.push(encode(tok, " Hello")) == " Hello"


def test_skip_special_tokens(tok: Any) -> None:
    ids = [*encode(tok, "Hello again"), EOS_ID]
    detok = IncrementalDetokenizer(tok)
    assert stream(detok, ids, [1] * len(ids))[-2:] == ["", ""]
    assert detok.text == "Hello again"

    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert stream(detok, ids, [1] * len(ids))[-2:] == ["<|end_of_text|>", ""]
    assert detok.text == "Hello again<|end_of_text|>"


def test_special_token_in_the_middle(tok: Any) -> None:
    ids = [*encode(tok, "a🚂"), EOS_ID, *encode(tok, " b")]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        chunks = stream(detok, ids, [1] * len(ids))
        assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)


def test_flush_returns_partial_character(tok: Any) -> None:
    ids = encode(tok, "ok") + encode(tok, "🚂")[:2]
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:-2]) == "ok"
    assert detok.push(ids[-2:]) == ""
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.text == tok.decode(ids) == "ok" + REPLACEMENT_CHAR
    assert detok.flush() == ""


def test_push_several_ids_at_once(tok: Any) -> None:
    text = SAMPLES[3]
    ids = encode(tok, text)
    one_by_one = IncrementalDetokenizer(tok)
    stream(one_by_one, ids, [1] * len(ids))
    all_at_once = IncrementalDetokenizer(tok)
    assert all_at_once.push(ids) == text
    assert all_at_once.flush() == ""
    in_threes = IncrementalDetokenizer(tok)
    chunks = stream(in_threes, ids, [3] * len(ids))
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)
    assert one_by_one.text == all_at_once.text == in_threes.text == text


def test_empty_push(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok)
    assert detok.push([]) == ""
    assert detok.flush() == ""
    assert detok.text == ""


def test_decode_window_stays_bounded(tok: Any) -> None:
    decoder = CountingDecoder(tok)
    ids = encode(tok, " ".join(SAMPLES) * 12)
    assert len(ids) > 1500
    detok = IncrementalDetokenizer(decoder, encode(tok, "Hello"))
    chunks = stream(detok, ids, [1] * len(ids))
    assert "".join(chunks) == tok.decode(ids)
    assert max(decoder.sizes) <= 20


def test_window_bounded_when_no_push_ends_on_a_character(tok: Any) -> None:
    # Three-byte characters pushed as byte tokens three at a time, shifted by one:
    # every push ends inside a character, for the whole stream.
    text = "日本語のテキスト" * 40
    ids = byte_ids(tok, text)
    decoder = CountingDecoder(tok)
    detok = IncrementalDetokenizer(decoder)
    chunks = stream(detok, ids, [1] + [3] * (len(ids) // 3))
    assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks)
    assert "".join(chunks) == text
    assert max(decoder.sizes) <= FORCE_LIMIT + 3


def test_invalid_bytes_do_not_grow_the_window(tok: Any) -> None:
    # A lone continuation byte, over and over: never a valid character.
    ids = byte_ids(tok, "é")[1:] * 500
    decoder = CountingDecoder(tok)
    detok = IncrementalDetokenizer(decoder)
    stream(detok, ids, [1] * len(ids))
    assert max(decoder.sizes) <= 2 * FORCE_LIMIT
    assert set(detok.text) == {REPLACEMENT_CHAR}


def random_text(rng: random.Random) -> str:
    alphabet = (
        "abcdefghijklmnopqrstuvwxyz      .,!?0123456789"
        "éèàüßçñøÅ"
        "日本語のテキストこんにちは世界"
        "🚂🚃🚄✨😀🎉"
        "\u200d\u0301"
    )
    return "".join(rng.choices(alphabet, k=rng.randint(1, 60)))


def test_random_texts_stream_like_full_decode(tok: Any) -> None:
    rng = random.Random(20240601)
    for _ in range(300):
        text = random_text(rng)
        ids = encode(tok, text)
        prompt = encode(tok, random_text(rng)) if rng.random() < 0.5 else []
        sizes = [rng.choice((1, 1, 1, 2, 3, 7)) for _ in ids]
        detok = IncrementalDetokenizer(tok, prompt)
        chunks = stream(detok, ids, sizes)
        assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks), text
        assert "".join(chunks) == tok.decode(ids) == text
        assert detok.text == text


def test_random_byte_token_streams(tok: Any) -> None:
    rng = random.Random(7)
    for _ in range(100):
        text = random_text(rng)
        ids = byte_ids(tok, text)
        sizes = [rng.randint(1, 4) for _ in ids]
        detok = IncrementalDetokenizer(tok)
        chunks = stream(detok, ids, sizes)
        assert all(REPLACEMENT_CHAR not in chunk for chunk in chunks), text
        assert "".join(chunks) == text


@pytest.fixture(scope="module")
def control_tok() -> Tokenizer:
    return Tokenizer(str(ensure_tiny_model()))


class CountingTokenizer:
    """The control plane's tokenizer, counting its decode calls."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.calls = 0

    def decode(self, ids: Sequence[int], /, skip_special_tokens: bool) -> str:
        self.calls += 1
        return self.tok.decode(ids, skip_special_tokens)


@settings(max_examples=300, deadline=None)
@given(
    out=st.lists(st.integers(0, 511), max_size=80),
    prompt=st.lists(st.integers(0, 511), max_size=8),
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=80),
    skip=st.booleans(),
)
def test_random_ids_with_pieces_stream_as_the_whole_decode(
    control_tok: Tokenizer, out: list[int], prompt: list[int], sizes: list[int], skip: bool
) -> None:
    """Tokens with a piece of their own are appended without a decode; mixed with byte
    pieces of characters and special tokens, the text is still the whole decode's."""
    assert control_tok.vocabulary.has_pieces
    detok = control_tok.detokenizer(prompt, skip)
    chunks = stream(detok, out, [*sizes, len(out)])
    whole = control_tok.decode(prompt[-5:] + out, skip)[
        len(control_tok.decode(prompt[-5:], skip)) :
    ]
    assert "".join(chunks) == whole


def test_whole_words_after_the_first_need_no_decode(control_tok: Tokenizer) -> None:
    counting = CountingTokenizer(control_tok)
    prompt = control_tok.encode("Hello, world!", True)
    detok = IncrementalDetokenizer(
        counting, prompt, vocabulary=control_tok.vocabulary, skip_special_tokens=True
    )
    ids = control_tok.encode(" The quick brown fox jumps over the lazy dog near the river", False)
    assert all(control_tok.vocabulary.piece(t) is not None for t in ids)
    calls_before = counting.calls
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == " The quick brown fox jumps over the lazy dog near the river"
    # One decode per cut of the window (every WINDOW_LIMIT - CONTEXT_TOKENS tokens) and
    # the flush's, not one per token.
    assert counting.calls - calls_before <= 2 + len(ids) // 10 < len(ids)


def test_byte_level_tokens_are_their_bytes(control_tok: Tokenizer) -> None:
    """Each token of the byte-level vocabulary (added ones aside) is its bytes: they read
    as the token's own decode wherever that decode is whole characters."""
    vocabulary = control_tok.vocabulary
    assert vocabulary.has_bytes
    checked = 0
    for token_id in range(control_tok.vocab_size):
        raw = vocabulary.token_bytes(token_id)
        if token_id in vocabulary.special_ids:
            assert raw is None
            continue
        assert raw, token_id
        text = control_tok.decode([token_id], False)
        assert raw.decode(errors="replace") == text
        checked += 1
    assert checked >= control_tok.vocab_size - 2


@settings(max_examples=200, deadline=None)
@given(out=st.lists(st.integers(2, 511), min_size=1, max_size=120))
def test_byte_level_streams_need_no_decode_per_token(
    control_tok: Tokenizer, out: list[int]
) -> None:
    """After a prompt of whole characters, any byte-level ids (characters cut anywhere,
    invalid bytes) stream as the whole decode with no decode call until the flush."""
    counting = CountingTokenizer(control_tok)
    prompt = control_tok.encode("Hello, world!", True)
    detok = IncrementalDetokenizer(
        counting, prompt, vocabulary=control_tok.vocabulary, skip_special_tokens=True
    )
    calls_before = counting.calls
    text = "".join(detok.push([t]) for t in out)
    assert counting.calls == calls_before
    text += detok.flush()
    whole = control_tok.decode(prompt[-5:] + out, True)[
        len(control_tok.decode(prompt[-5:], True)) :
    ]
    assert text == whole


def test_a_character_the_prompt_began_is_not_read_twice(control_tok: Tokenizer) -> None:
    """The prompt ends with the first byte of a character and the output brings the
    rest: its bytes are not read as a new character's."""
    first, second, third = byte_ids(control_tok._hf, "ൃ")
    prompt = [*control_tok.encode("Hi", False), first]
    detok = control_tok.detokenizer(prompt, True)
    text = detok.push([second]) + detok.push([third]) + detok.push(control_tok.encode(" ok", False))
    text += detok.flush()
    whole = control_tok.decode([*prompt, second, third, *control_tok.encode(" ok", False)], True)
    assert text == whole[len(control_tok.decode(prompt, True)) :] == " ok"


@settings(max_examples=300, deadline=None)
@given(
    out=st.lists(st.integers(0, 515), max_size=100),
    prompt=st.lists(st.integers(0, 511), max_size=8),
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=100),
    away=st.lists(st.booleans(), min_size=1, max_size=100),
    skip=st.booleans(),
)
def test_tokens_read_on_elsewhere_and_adopted_give_the_whole_decode(
    control_tok: Tokenizer,
    out: list[int],
    prompt: list[int],
    sizes: list[int],
    away: list[bool],
    skip: bool,
) -> None:
    """The native front's direct path: whenever `held_bytes` says the next tokens' text is
    their bytes, chunks are made elsewhere (the front's own UTF-8 reader, from the held
    bytes on) and `adopt`ed; the text, both sides together, is the whole decode's, and
    the detokenizer goes on from there as if it had pushed them (special tokens and ids
    past the vocabulary included: those have no bytes and stay here)."""
    vocabulary = control_tok.vocabulary
    detok = control_tok.detokenizer(prompt, skip)
    chunks: list[str] = []
    held: bytes | None = None  # the front's held bytes while it has the stream
    i = k = 0
    while i < len(out):
        ids = out[i : i + sizes[k % len(sizes)]]
        parts = [vocabulary.token_bytes(t) for t in ids]
        if held is None and away[k % len(away)]:
            held = detok.held_bytes()
        if held is not None and None not in parts:
            text, held = rt.utf8_append(held, b"".join(p for p in parts if p is not None))
            chunks.append(text.decode())
            detok.adopt(ids)
        else:  # the front hands the stream back
            held = None
            chunks.append(detok.push(ids))
        i += len(ids)
        k += 1
    chunks.append(detok.flush())
    whole = control_tok.decode(prompt[-5:] + out, skip)[
        len(control_tok.decode(prompt[-5:], skip)) :
    ]
    assert "".join(chunks) == whole
