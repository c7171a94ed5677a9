"""The model's Hugging Face tokenizer, as the control plane uses it.

Text is the control plane's job: workers only ever see token ids. Encoding and decoding
go straight to the Rust `tokenizers` backend when the tokenizer has one.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from control.errors import FailedPrecondition, InvalidArgument
from control.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, Vocabulary

log = structlog.get_logger(__name__)


# Text longer than this is tokenized in a thread, off the event loop, so that the loop
# keeps serving every other stream meanwhile.
INLINE_MAX_CHARS = 4096

# transformers imports its classes lazily on first use, and two threads doing that first
# import at once can see a half-initialised module ("cannot import name 'AutoTokenizer'").
# Tokenizers are built in threads, one per model at start-up: one at a time.
_LOAD_LOCK = threading.Lock()


class Tokenizer:
    def __init__(self, path: str) -> None:
        self.path = path
        with _LOAD_LOCK:
            from transformers import AutoTokenizer

            self._hf: Any = AutoTokenizer.from_pretrained(path)
        # The fast backend skips transformers' Python layers on every call.
        self._fast: Any = getattr(self._hf, "_tokenizer", None)
        self.vocab_size = len(self._hf)
        eos = self._hf.eos_token_id
        self.eos_token_id: int | None = int(eos) if eos is not None else None
        self.vocabulary = _vocabulary(self._hf, self._fast)
        log.info("tokenizer loaded", path=path, vocab_size=self.vocab_size)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is not None:
            ids: list[int] = self._fast.encode(text, add_special_tokens=add_special_tokens).ids
            return ids
        out: list[int] = self._hf.encode(text, add_special_tokens=add_special_tokens)
        return out

    async def encode_off_loop(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, in a thread when the text is long."""
        if len(text) <= INLINE_MAX_CHARS:
            return self.encode(text, add_special_tokens)
        return await asyncio.to_thread(self.encode, text, add_special_tokens)

    async def encode_chat(
        self, messages: Sequence[tuple[str, str]], template: str | None, model: str
    ) -> list[int]:
        """A conversation's prompt ids (`render_chat`, then `encode`; the template writes
        the special tokens it wants, so none are added), in a thread when it is long."""

        def render_and_encode() -> list[int]:
            return self.encode(self.render_chat(messages, template, model), False)

        if sum(len(content) for _, content in messages) <= INLINE_MAX_CHARS:
            return render_and_encode()
        return await asyncio.to_thread(render_and_encode)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        if self._fast is not None:
            if not isinstance(ids, list):
                ids = list(ids)
            text: str = self._fast.decode(ids, skip_special_tokens=skip_special_tokens)
            return text
        out: str = self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return out

    @property
    def chat_template(self) -> str | None:
        template = getattr(self._hf, "chat_template", None)
        return template if isinstance(template, str) and template else None

    def render_chat(
        self, messages: Sequence[tuple[str, str]], template: str | None, model: str
    ) -> str:
        """The prompt text of a conversation: `template` (the model's config's) or the
        tokenizer's own chat template, with the generation prompt added. Raises
        FailedPrecondition without a template, InvalidArgument when the template refuses
        the conversation (roles that do not alternate, say)."""
        template = template or self.chat_template
        if template is None:
            raise FailedPrecondition(
                f"model {model!r} has no chat template (neither its tokenizer nor its "
                "config's chat_template): send text or token_ids instead of messages"
            )
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            text: str = self._hf.apply_chat_template(
                conversation, chat_template=template, tokenize=False, add_generation_prompt=True
            )
        except Exception as e:  # jinja2's TemplateError, or the template's raise_exception
            raise InvalidArgument.for_field(
                "messages", f"the chat template of {model!r} refused it: {e}"
            ) from e
        return text

    def tokens(self, ids: Sequence[int]) -> list[str]:
        out: list[str] = self._hf.convert_ids_to_tokens(list(ids))
        return out

    def detokenizer(
        self, prompt_ids: Sequence[int], skip_special_tokens: bool
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self, prompt_ids, skip_special_tokens=skip_special_tokens, vocabulary=self.vocabulary
        )


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _vocabulary(hf: Any, fast: Any) -> Vocabulary:
    """The special tokens; the byte tokens of a tokenizer whose decoder has byte fallback
    (SentencePiece models such as Llama 2 and Mistral); and the tokens' pieces when its
    decoder only joins their texts."""
    if fast is None:  # transformers' own decode skips these
        return Vocabulary(int(i) for i in getattr(hf, "all_special_ids", ()))
    # The Rust decode skips its added tokens marked special, and only those; no added
    # token has a piece (they are decoded apart from the decoder).
    added = fast.get_added_tokens_decoder()
    special = [i for i, t in added.items() if t.special]
    decoder = json.loads(fast.to_str()).get("decoder")
    byte_ids: list[int] = []
    if '"ByteFallback"' in json.dumps(decoder):
        byte_ids = [i for token, i in fast.get_vocab().items() if _BYTE_TOKEN.fullmatch(token)]
    added_ids = frozenset(added)
    bytes_of = _byte_level(fast, added_ids) if _is_byte_level(decoder) else None
    anchor = fast.token_to_id("a")
    if not _joins_texts(decoder) or anchor is None:
        return Vocabulary(special, byte_ids, bytes_of=bytes_of, size=len(hf))
    anchor_text = fast.decode([anchor], skip_special_tokens=False)

    def piece_of(token_id: int) -> str | None:
        if token_id in added_ids:
            return None
        text: str = fast.decode([anchor, token_id], skip_special_tokens=False)
        if not text.startswith(anchor_text) or REPLACEMENT_CHAR in text:
            return None  # part of a character (or not a token at all)
        return text[len(anchor_text) :]

    return Vocabulary(special, byte_ids, piece_of, bytes_of, size=len(hf))


def _is_byte_level(decoder: Any) -> bool:
    return isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE spells each byte as one printable character: the bytes that are
    printable Latin-1 as themselves, the other 68 as U+0100 onwards, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {chr(b): b for b in kept}
    others = (b for b in range(256) if b not in chars.values())
    for n, b in enumerate(others):
        chars[chr(0x100 + n)] = b
    return chars


def _byte_level(fast: Any, added_ids: frozenset[int]) -> Callable[[int], bytes | None]:
    """A byte-level BPE token's bytes (None for an added token, or an unknown id)."""
    alphabet = _byte_alphabet()

    def bytes_of(token_id: int) -> bytes | None:
        if token_id in added_ids:
            return None
        token: str | None = fast.id_to_token(token_id)
        if token is None:
            return None
        try:
            return bytes(alphabet[c] for c in token)
        except KeyError:  # not a byte-level spelling
            return None

    return bytes_of


# Decoders whose text for a token sequence is the texts of its tokens joined (past the
# first token, which Strip may shorten): byte-level BPE, and SentencePiece's
# replace-and-fuse (its byte runs are handled apart).
_JOINING = {"ByteLevel", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}


def _joins_texts(decoder: Any) -> bool:
    if not isinstance(decoder, dict):
        return False
    kind = decoder.get("type")
    if kind == "Sequence":
        return all(_joins_texts(d) for d in decoder.get("decoders", ()))
    if kind == "Replace":
        return (
            decoder.get("pattern", {}).get("String") == "\u2581" and decoder.get("content") == " "
        )
    if kind == "Strip":
        return bool(decoder.get("stop", 0) == 0)  # from the start only
    return kind in _JOINING
