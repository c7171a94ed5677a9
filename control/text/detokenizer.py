"""Incremental detokenization: turn a stream of generated token ids into text chunks.

Decoding each token on its own is wrong for byte-level BPE: one character can span
several tokens, and how a token decodes can depend on the tokens before it.
`IncrementalDetokenizer` uses the prefix-offset / read-offset technique (as in TGI and
vLLM): it decodes a short window of ids whose first few tokens are already-decoded
context, and emits the text beyond that context once it no longer ends with U+FFFD
(an unfinished character). The window is cut back to its last few tokens as it grows,
so the cost of a push does not grow with the length of the output.

SentencePiece tokenizers with byte fallback (Llama 2, Mistral) spell a character their
vocabulary lacks as tokens `<0xE6>` `<0x97>` `<0xA5>`, and their decoder turns each run of
such byte tokens into text as a whole: one invalid byte anywhere in the run makes every
byte of it U+FFFD, even the bytes of characters that were complete before it. So the
text of a run of byte tokens is held back until the run ends (a token that is not a
byte comes), and the streamed text is exactly the whole decode's.
"""

from __future__ import annotations

import codecs
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
_NO_BYTES = struct.pack("<i", -1)
# Tokens of already-decoded text kept in front of new ones (prompt tail, or output).
CONTEXT_TOKENS = 5
# Cut the window back to CONTEXT_TOKENS once it is this long and fully emitted.
WINDOW_LIMIT = 16
# A window this long that still ends mid-character (a long run of tokens that all end
# inside a character, or invalid bytes) emits what is settled so it can be cut back.
FORCE_LIMIT = 32
# At most this many trailing U+FFFDs can still turn into a character: one per byte of
# an unfinished UTF-8 sequence when a decoder replaces byte by byte, otherwise one.
MAX_UNSETTLED = 3


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (a Hugging Face tokenizer fits)."""

    def decode(self, ids: Sequence[int], /, skip_special_tokens: bool) -> str: ...


class Vocabulary:
    """What the detokenizer needs to know of a vocabulary: its special tokens (which
    decoding may skip); when its decoder has byte fallback, its byte tokens (`<0x00>` to
    `<0xFF>`; empty otherwise); and, when its decoder only joins the tokens' texts
    (byte-level BPE, SentencePiece), `piece`: a token's text after other text (None for a
    token that is part of a character, a byte token, or a special one). With pieces, a
    push that follows fully emitted text needs no decode: its text is its pieces'.
    When the decoder is byte-level BPE, `token_bytes`: a token's bytes (None for an added
    token, which is decoded apart)."""

    __slots__ = (
        "__weakref__",  # the native front keeps its tables by vocabulary, weakly
        "_byte_cache",
        "_bytes_of",
        "_cache",
        "_piece_of",
        "byte_ids",
        "size",
        "special_ids",
    )

    def __init__(
        self,
        special_ids: Iterable[int],
        byte_ids: Iterable[int] = (),
        piece_of: Callable[[int], str | None] | None = None,
        bytes_of: Callable[[int], bytes | None] | None = None,
        size: int = 0,
    ) -> None:
        self.special_ids = frozenset(special_ids)
        self.size = size  # how many ids it has (the tokenizer's length), when known
        self.byte_ids = frozenset(byte_ids)
        self._piece_of = piece_of
        self._bytes_of = bytes_of
        self._cache: dict[int, str | None] = {}
        self._byte_cache: dict[int, bytes | None] = {}

    @property
    def has_pieces(self) -> bool:
        return self._piece_of is not None

    @property
    def has_bytes(self) -> bool:
        return self._bytes_of is not None

    def token_bytes(self, token_id: int) -> bytes | None:
        try:
            return self._byte_cache[token_id]
        except KeyError:
            pass
        raw = None
        if self._bytes_of is not None and token_id not in self.special_ids:
            raw = self._bytes_of(token_id)
        self._byte_cache[token_id] = raw
        return raw

    def byte_table(self) -> bytes:
        """Every token's bytes (`token_bytes`) for ids below `size`, for the native front's
        direct path (runtime_cpp/src/front/direct.h): per id a little-endian int32 length,
        -1 for none, then the bytes. The front asks once per vocabulary and keeps its copy."""
        parts = []
        for token_id in range(self.size):
            raw = self.token_bytes(token_id)
            parts.append(_NO_BYTES if raw is None else struct.pack("<i", len(raw)) + raw)
        return b"".join(parts)

    def piece(self, token_id: int) -> str | None:
        try:
            return self._cache[token_id]
        except KeyError:
            pass
        text = None
        if (
            self._piece_of is not None
            and token_id not in self.byte_ids
            and token_id not in self.special_ids
        ):
            text = self._piece_of(token_id)
        self._cache[token_id] = text
        return text


class IncrementalDetokenizer:
    """Turns token ids, pushed as they are generated, into complete-character text."""

    def __init__(
        self,
        decoder: TokenDecoder,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        vocabulary: Vocabulary | None = None,
    ) -> None:
        self._decoder = decoder
        self._skip_special_tokens = skip_special_tokens
        # Special tokens that decoding skips are left out of the window, so that they
        # never take the place of context (a window of only skipped tokens decodes as "",
        # and the next word would lose its leading space).
        self._skipped = vocabulary.special_ids if vocabulary and skip_special_tokens else None
        self._bytes = vocabulary.byte_ids if vocabulary and vocabulary.byte_ids else None
        self._pieces = vocabulary if vocabulary and vocabulary.has_pieces else None
        self._utf8 = vocabulary if vocabulary and vocabulary.has_bytes else None
        # Reads the bytes of byte-level tokens pushed after settled text; `_pending` while
        # it holds the start of a character (the window's decode then ends with it).
        self._codec = _UTF8(errors="replace") if self._utf8 is not None else None
        self._pending = False
        # The ids being decoded together: context first, then ids not yet fully emitted.
        self._window: list[int] = self._kept(prompt_ids)[-CONTEXT_TOKENS:] if prompt_ids else []
        # Where the window's trailing run of byte tokens starts (None: it ends in none).
        self._run: int | None = None
        # How many characters of decode(self._window) are context or already emitted.
        context = self._decode(self._window)
        self._done = len(context)
        # Whether the text of tokens with pieces (or bytes) is theirs, appended (`_whole`).
        self._settled = _whole(context, self._done)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (by `push` and `flush`)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, ids: Sequence[int]) -> str:
        """Add generated token ids; return the newly completed text ("" if none)."""
        if self._skipped is not None:
            ids = self._kept(ids)
        if not ids:
            return ""
        if self._utf8 is not None:
            if self._settled or self._pending:
                text = self._joined_bytes(ids)
                if text is not None:
                    return text
                if self._pending:  # its bytes are in the window: the decode below has them
                    self._pending = False
                    assert self._codec is not None
                    self._codec.reset()
        elif self._settled and self._pieces is not None:
            text = self._joined_pieces(ids)
            if text is not None:
                return text
        if self._bytes is not None and self._track_run(ids):
            # The run's text can still change: only what comes before it is settled.
            self._window.extend(ids)
            self._settled = False
            assert self._run is not None
            return self._emit(self._decode(self._window[: self._run]), -1)
        self._window.extend(ids)
        full = self._decode(self._window)
        if not full.endswith(REPLACEMENT_CHAR):
            end = len(full)
        elif len(self._window) >= FORCE_LIMIT:
            end = _settled_length(full)
        else:
            end = self._done  # an unfinished character: hold everything back
        chunk = self._emit(full, end)
        self._settled = _whole(full, self._done)
        if len(self._window) >= (WINDOW_LIMIT if self._done >= len(full) else FORCE_LIMIT):
            self._cut_window(full)
        return chunk

    def held_bytes(self) -> bytes | None:
        """When the next tokens' text is their bytes read on from what is emitted (the
        path `push` takes for tokens that all have bytes): the bytes of an unfinished
        character held so far (b"" for none). None otherwise. Whoever reads tokens on from
        here must give them back to `adopt` before the next `push`."""
        if self._codec is None or not (self._settled or self._pending):
            return None
        held: bytes = self._codec.getstate()[0]
        return held

    def adopt(self, ids: Sequence[int]) -> None:
        """Tokens whose text was read on from `held_bytes` elsewhere (and emitted there):
        the state becomes what pushing them here would have made it."""
        if ids and self._joined_bytes(ids) is None:
            raise ValueError("adopted tokens must all have bytes")

    def _joined_pieces(self, ids: Sequence[int]) -> str | None:
        """The text of `ids` after settled text, when every one has a piece (no decode)."""
        assert self._pieces is not None
        piece = self._pieces.piece
        if len(ids) == 1:
            text = piece(ids[0])
            if text is None:
                return None
        else:
            parts = [piece(t) for t in ids]
            if None in parts:
                return None
            text = "".join(parts)  # type: ignore[arg-type]
        self._append(ids, text)
        self._cut_settled(self._decode)
        return text

    def _joined_bytes(self, ids: Sequence[int]) -> str | None:
        """The text of `ids` after settled text (or after bytes the codec holds), when
        every one has bytes: read by the incremental UTF-8 decoder, no decode call."""
        assert self._utf8 is not None and self._codec is not None
        token_bytes = self._utf8.token_bytes
        if len(ids) == 1:
            raw = token_bytes(ids[0])
            if raw is None:
                return None
        else:
            parts = [token_bytes(t) for t in ids]
            if None in parts:
                return None
            raw = b"".join(parts)  # type: ignore[arg-type]
        codec = self._codec
        text = codec.decode(raw)
        self._append(ids, text)
        self._pending = pending = bool(codec.getstate()[0])
        self._settled = not pending
        if not pending:
            self._cut_settled(self._bytes_text)
        return text

    def _bytes_text(self, ids: Sequence[int]) -> str:
        """decode(ids), from the tokens' bytes when all have them."""
        assert self._utf8 is not None
        parts = [self._utf8.token_bytes(t) for t in ids]
        if None in parts:
            return self._decode(ids)
        return b"".join(parts).decode(errors="replace")  # type: ignore[arg-type]

    def _append(self, ids: Sequence[int], text: str) -> None:
        """`ids` join the window, and their `text` is emitted."""
        self._window.extend(ids)
        self._done += len(text)
        if text:
            self._chunks.append(text)

    def _cut_settled(self, decode: Callable[[Sequence[int]], str]) -> None:
        """With all of the window's text emitted: once it is long, keep its last tokens."""
        if len(self._window) >= WINDOW_LIMIT:
            tail = self._window[-CONTEXT_TOKENS:]
            tail_text = decode(tail)
            if tail_text:  # else keep the window: a word after it would lose its space
                self._window = tail
                self._done = len(tail_text)

    def flush(self) -> str:
        """End of stream: return the text still held back.

        It ends with U+FFFD if the stream stopped in the middle of a character.
        """
        if self._pending:  # the decode below ends with the bytes the codec holds
            self._pending = False
            assert self._codec is not None
            self._codec.reset()
        full = self._decode(self._window)
        return self._emit(full, len(full))

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._decoder.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _kept(self, ids: Sequence[int]) -> list[int]:
        skipped = self._skipped
        if not skipped or skipped.isdisjoint(ids):
            return ids if isinstance(ids, list) else list(ids)  # read, never changed
        return [t for t in ids if t not in skipped]

    def _track_run(self, ids: Sequence[int]) -> bool:
        """Follow the trailing run of byte tokens through `ids` (about to be added to the
        window); whether the window then ends in one."""
        assert self._bytes is not None
        is_byte = self._bytes
        run = self._run
        at = len(self._window)
        for i, t in enumerate(ids):
            if t in is_byte:
                if run is None:
                    run = at + i
            else:
                run = None
        self._run = run
        return run is not None

    def _emit(self, full: str, end: int) -> str:
        """Emit `full` up to `end` (-1: all of it) beyond what is emitted already."""
        if end < 0:
            end = len(full)
        if end <= self._done:
            return ""
        chunk = full[self._done : end]
        self._done = end
        self._chunks.append(chunk)
        return chunk

    def _cut_window(self, full: str) -> None:
        """Keep only the last CONTEXT_TOKENS ids, if their decode lines up with `full`.

        Decoding the tail can differ from `full` at its start (a character cut in two
        decodes as U+FFFDs, a leading space may be dropped), but that part has been
        emitted already. What is still pending must be exactly the end of the tail's
        decode, preceded by a real character, so the two decodes agree from there on.
        """
        pending = full[self._done :]
        tail = self._window[-CONTEXT_TOKENS:]
        tail_text = self._decode(tail)
        done = len(tail_text) - len(pending)
        if pending and (
            done <= 0 or not tail_text.endswith(pending) or tail_text[done - 1] == REPLACEMENT_CHAR
        ):
            if len(self._window) < 2 * FORCE_LIMIT:
                return
            # Only reachable on streams of invalid bytes: give up on the held U+FFFDs
            # rather than let the window grow without bound.
            self._emit(full, len(full))
            done = len(tail_text)
        self._window = tail
        self._done = done
        self._settled = _whole(tail_text, done)


_UTF8 = codecs.getincrementaldecoder("utf-8")


def _whole(text: str, done: int) -> bool:
    """Whether `text` (a window's decode) is all emitted, is not empty and ends on a whole
    character: a token's text can then be appended to it (a trailing U+FFFD may still
    become a character, or an emitted one may have been an unfinished character)."""
    return 0 < done == len(text) and not text.endswith(REPLACEMENT_CHAR)


def _settled_length(text: str) -> int:
    """Length of `text` without the trailing U+FFFDs that may still become a character."""
    end = len(text)
    floor = max(0, end - MAX_UNSETTLED)
    while end > floor and text[end - 1] == REPLACEMENT_CHAR:
        end -= 1
    return end
