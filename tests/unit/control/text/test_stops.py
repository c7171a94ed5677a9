from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from control.text.stops import StopMatcher, StopResult


def feed(matcher: StopMatcher, pieces: Sequence[str]) -> tuple[list[str], str | None]:
    """Push pieces until a stop matches; return the emitted chunks and the stop."""
    out: list[str] = []
    for piece in pieces:
        result = matcher.push(piece)
        out.append(result.text)
        if result.stop is not None:
            return out, result.stop
    out.append(matcher.flush())
    return out, None


def test_single_chunk_match() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("hello STOP world") == StopResult("hello ", "STOP")


def test_stop_split_across_two_chunks() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("hello ST") == StopResult("hello ", None)
    assert m.push("OP and more") == StopResult("", "STOP")


def test_stop_split_across_three_chunks() -> None:
    m = StopMatcher(["</answer>"])
    assert m.push("42</an") == StopResult("42", None)
    assert m.push("swe") == StopResult("", None)
    assert m.push("r>tail") == StopResult("", "</answer>")


def test_held_text_released_when_no_match() -> None:
    m = StopMatcher(["abc"])
    assert m.push("ab") == StopResult("", None)
    assert m.push("x") == StopResult("abx", None)
    assert m.push("a") == StopResult("", None)
    assert m.push("bd") == StopResult("abd", None)
    assert m.flush() == ""


def test_partial_release_keeps_possible_prefix() -> None:
    m = StopMatcher(["abc"])
    assert m.push("xab") == StopResult("x", None)
    # "aba": "ab" cannot continue, but the last "a" still can.
    assert m.push("a") == StopResult("ab", None)
    assert m.push("bc!") == StopResult("", "abc")


def test_include_stop() -> None:
    m = StopMatcher(["END"], include_stop=True)
    assert m.push("the E") == StopResult("the ", None)
    assert m.push("ND!!") == StopResult("END", "END")

    m = StopMatcher(["END"], include_stop=False)
    assert m.push("the E") == StopResult("the ", None)
    assert m.push("ND!!") == StopResult("", "END")


def test_earliest_position_wins() -> None:
    m = StopMatcher(["world", "lo", "xyz"])
    assert m.push("hello world") == StopResult("hel", "lo")

    m = StopMatcher(["lo w", "o"], include_stop=True)
    assert m.push("hello world") == StopResult("hello", "o")


def test_same_end_longest_wins() -> None:
    m = StopMatcher(["c", "bc", "abc"])
    assert m.push("xxabcyy") == StopResult("xx", "abc")

    m = StopMatcher(["c", "bc"], include_stop=True)
    assert m.push("xxabcyy") == StopResult("xxabc", "bc")


def test_first_completed_stop_wins_whatever_the_chunking() -> None:
    # "bc" is complete before "abcd" could be, so it ends the stream either way.
    m = StopMatcher(["abcd", "bc"])
    assert m.push("abcd") == StopResult("a", "bc")

    m = StopMatcher(["abcd", "bc"])
    assert feed(m, ["a", "b", "c", "d"]) == (["", "", "a"], "bc")


def test_overlapping_prefixes() -> None:
    m = StopMatcher(["aab"])
    assert m.push("a") == StopResult("", None)
    assert m.push("a") == StopResult("", None)
    assert m.push("a") == StopResult("a", None)
    assert m.push("b") == StopResult("", "aab")


def test_overlapping_prefixes_include_stop() -> None:
    m = StopMatcher(["aab"], include_stop=True)
    assert feed(m, ["a", "a", "a", "b", "zzz"]) == (["", "", "a", "aab"], "aab")


def test_stop_at_very_start() -> None:
    m = StopMatcher(["###"])
    assert m.push("###rest") == StopResult("", "###")

    m = StopMatcher(["###"])
    assert m.push("#") == StopResult("", None)
    assert m.push("##") == StopResult("", "###")


def test_flush_returns_held_tail() -> None:
    m = StopMatcher(["<|im_end|>"])
    assert m.push("done <|im") == StopResult("done ", None)
    assert m.flush() == "<|im"
    assert m.flush() == ""


def test_push_after_match_raises() -> None:
    m = StopMatcher(["x"])
    assert m.push("axb").stop == "x"
    with pytest.raises(RuntimeError):
        m.push("more")
    assert m.flush() == ""


def test_no_stops_passthrough() -> None:
    m = StopMatcher([])
    for piece in ["a", "", "bc", "\ufffd", "x" * 1000]:
        result = m.push(piece)
        assert result.text is piece
        assert result.stop is None
    assert m.flush() == ""


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        StopMatcher(["ok", ""])


def test_bare_string_rejected() -> None:
    with pytest.raises(TypeError):
        StopMatcher("abc")


def test_empty_pieces() -> None:
    m = StopMatcher(["ab"])
    assert m.push("") == StopResult("", None)
    assert m.push("a") == StopResult("", None)
    assert m.push("") == StopResult("", None)
    assert m.push("b") == StopResult("", "ab")


def test_duplicate_stops() -> None:
    m = StopMatcher(["ab", "ab"])
    assert m.push("xaby") == StopResult("x", "ab")


def test_unicode_stop_strings() -> None:
    m = StopMatcher(["🚂🚃", "。"])
    assert m.push("乗り物🚂") == StopResult("乗り物", None)
    assert m.push("🚄") == StopResult("🚂🚄", None)
    assert m.push("🚂") == StopResult("", None)
    assert m.push("🚃です") == StopResult("", "🚂🚃")

    m = StopMatcher(["。"], include_stop=True)
    assert feed(m, ["こんにちは", "世界。", "次"]) == (["こんにちは", "世界。"], "。")


def reference(text: str, stops: Sequence[str], include_stop: bool) -> tuple[str, str | None]:
    """Whole-text answer: the stop that is complete first, the longest on a tie."""
    for end in range(1, len(text) + 1):
        found = [s for s in stops if text.endswith(s, 0, end)]
        if found:
            stop = max(found, key=len)
            cut = end if include_stop else end - len(stop)
            return text[:cut], stop
    return text, None


def test_random_chunkings_match_reference() -> None:
    rng = random.Random(1234)
    for _ in range(400):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("abcd", k=rng.randint(0, 30)))
        include_stop = rng.random() < 0.5
        pieces: list[str] = []
        i = 0
        while i < len(text):
            n = rng.randint(0, 5)
            pieces.append(text[i : i + n])
            i += n
        chunks, stop = feed(StopMatcher(stops, include_stop=include_stop), pieces)
        assert ("".join(chunks), stop) == reference(text, stops, include_stop)
        # Exactly the longest tail that could still grow into a stop is held back.
        m = StopMatcher(stops, include_stop=include_stop)
        emitted = consumed = ""
        for piece in pieces:
            result = m.push(piece)
            if result.stop is not None:
                break
            emitted += result.text
            consumed += piece
            held = consumed[len(emitted) :]
            assert consumed.startswith(emitted)
            tails = (consumed[len(consumed) - n :] for n in range(len(consumed) + 1))
            assert len(held) == max(len(t) for t in tails if is_proper_prefix(t, stops))


def is_proper_prefix(tail: str, stops: Sequence[str]) -> bool:
    return tail == "" or any(s.startswith(tail) and s != tail for s in stops)
