"""The native front's UTF-8 reader (runtime_cpp/src/front/utf8.h) against Python's own
incremental decoder with errors="replace", which the control plane's detokenizer uses:
the same text and the same bytes held back, for any bytes cut into any pieces. The
front's chunks of a stream are made with it, so the text a client sees must not depend
on which side made a chunk."""

from __future__ import annotations

import codecs

import switchyard_runtime as rt
from hypothesis import given, settings
from hypothesis import strategies as st

# Bytes near UTF-8's edges: lead bytes of every length, continuation bytes, and bytes
# that start nothing, mixed with ASCII and whole characters.
EDGES = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF]
EDGES += [0xE0, 0xE1, 0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFE, 0xFF]
piece = st.one_of(
    st.binary(max_size=6),
    st.lists(st.sampled_from(EDGES), max_size=6).map(bytes),
    st.text(max_size=3).map(lambda s: s.encode("utf-8", "surrogatepass")),
)


@settings(max_examples=1500, deadline=None)
@given(st.lists(piece, max_size=12))
def test_the_front_reads_bytes_as_python_does(pieces: list[bytes]) -> None:
    python = codecs.getincrementaldecoder("utf-8")(errors="replace")
    held = b""
    for data in pieces:
        want = python.decode(data)
        text, held = rt.utf8_append(held, data)
        assert text.decode("utf-8") == want, (pieces, data)
        assert held == python.getstate()[0], (pieces, data)


def test_examples() -> None:
    whole = "h\u00e9 \U0001f682".encode()
    assert rt.utf8_append(b"", whole) == (whole, b"")
    assert rt.utf8_append(b"", b"a\xf0\x9f") == (b"a", b"\xf0\x9f")
    assert rt.utf8_append(b"\xf0\x9f", b"\x9a\x82") == ("\U0001f682".encode(), b"")
    assert rt.utf8_append(b"", b"\xe0\x80") == ("\ufffd\ufffd".encode(), b"")
    assert rt.utf8_append(b"", b"\xed\xa0") == (b"", b"\xed\xa0")  # CPython holds it
