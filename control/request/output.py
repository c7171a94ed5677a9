"""What the client sees of one request's tokens, whichever workers generated them.

`OutputState` takes the worker's chunks in order, across failovers (`push`), and gives
the public chunks back: the text detokenized incrementally, stop strings matched and the
output cut where one completes, the logprobs with each alternative's text, the prompt's
logprobs once. It fills the request's `Final` as it goes (the stop string, the stop or
EOS token, usage) and counts the generated tokens. It knows nothing of workers or
transport: it is tested with plain token ids (tests/unit/control/request/test_output.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from switchyard.v1 import common_pb2, generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.text.detokenizer import Vocabulary
from control.text.params import GenerationParams
from control.text.stops import StopMatcher
from control.text.tokenizer import Tokenizer

# The prompt's last tokens, for the first word's spacing when detokenizing.
PROMPT_CONTEXT_TOKENS = 5

# The generated-token counter is given its tokens this many at a time, and the rest when
# asked (`count`): once per chunk it was 5.5% of a busy control plane's time on the H200
# (docs/results/profiles.md), for a series read at scrape time.
COUNT_EVERY_TOKENS = 64

_STOP = common_pb2.FINISH_REASON_STOP


class OutputState:
    """One request's output so far: `generated` holds its token ids (the answer's only,
    cut at a stop string), `final` the Final being filled."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: GenerationParams,
        prompt_ids: Sequence[int],
        eos_token_ids: Sequence[int],
        final: generation_pb2.Final,
        count: Callable[[int], None],
    ) -> None:
        self.generated: list[int] = []
        self.final = final
        self._tokenizer = tokenizer
        self._params = params
        self._eos = frozenset(eos_token_ids)
        self._count = count
        self._uncounted = 0
        self._want_logprobs = params.logprobs is not None
        # Whether the prompt's logprobs may still come (once, in the first chunk that has them).
        self._prompt_logprobs_due = params.prompt_logprobs is not None
        self._detok = tokenizer.detokenizer(
            list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]), params.skip_special_tokens
        )
        self._matcher = (
            StopMatcher(params.stop, include_stop=params.include_stop) if params.stop else None
        )

    @property
    def stopped(self) -> bool:
        """A stop string has matched: the answer is complete."""
        return bool(self.final.stop_string)

    def push(self, chunk: worker_pb2.Chunk) -> generation_pb2.GenerateResponse:
        """The public chunk for a worker's chunk. After it, `stopped` says whether a stop
        string completed in it (its text and ids then end there)."""
        ids = list(chunk.token_ids)
        self.generated.extend(ids)
        text = self._detok.push(ids)
        if self._matcher is not None:
            text = self._match(text)
            if self.final.stop_string:
                ids = self._cut_at_stop(ids)
        out = generation_pb2.GenerateResponse()
        public = out.chunk  # built in place: no copy of a finished Chunk
        public.text = text
        public.token_ids.extend(ids)
        if self._want_logprobs:
            self._copy_logprobs(public.logprobs, chunk.logprobs[: len(ids)])
        if self._prompt_logprobs_due and chunk.prompt_logprobs:
            self._copy_logprobs(public.prompt_logprobs, chunk.prompt_logprobs)
            self._prompt_logprobs_due = False
        self._uncounted += len(ids)
        if self._uncounted >= COUNT_EVERY_TOKENS:
            self.count()
        return out

    # ---- the native direct path (control.request.direct) -----------------------------

    @property
    def vocabulary(self) -> Vocabulary:
        return self._tokenizer.vocabulary

    def may_be_plain(self) -> bool:
        """Whether its chunks can ever be plain: text that is the tokens' bytes (a
        byte-level vocabulary), and nothing else to add (logprobs, stop strings)."""
        return (
            self._matcher is None
            and not self._want_logprobs
            and self._params.prompt_logprobs is None
            and self._tokenizer.vocabulary.has_bytes
        )

    def plain_bytes(self) -> bytes | None:
        """When the next tokens' text is their bytes read on from the text so far: the
        bytes of an unfinished character held back (b"" for none); None otherwise."""
        return self._detok.held_bytes()

    def adopt(self, ids: Sequence[int]) -> None:
        """Tokens whose plain chunks were written elsewhere (after `plain_bytes`), and
        counted there (`count_tokens`): the state becomes what pushing them here would
        have made it."""
        self.generated.extend(ids)
        self._detok.adopt(ids)

    @property
    def count_tokens(self) -> Callable[[int], None]:
        """The generated-token counter, for tokens counted where they are written."""
        return self._count

    def take_final(self, wf: worker_pb2.Final) -> None:
        """The worker's Final: why it stopped, and the prompt tokens it found cached."""
        f = self.final
        f.finish_reason = wf.finish_reason
        # After a resume the worker's prompt includes generated tokens; cap at the prompt.
        f.usage.cached_prompt_tokens = min(wf.usage.cached_prompt_tokens, f.usage.prompt_tokens)
        which = wf.WhichOneof("stop_reason")
        if which == "eos_token_id":
            f.eos_token_id = wf.eos_token_id
        elif which == "stop_token_id":
            f.stop_token_id = wf.stop_token_id

    def ended_by_last_token(self) -> bool:
        """Whether the tokens so far already end the request (their worker failed before
        its Final): continuing would generate past the end. Fills the Final if so."""
        if not self.generated:
            return False
        last = self.generated[-1]
        if last in self._params.stop_token_ids:
            self.final.stop_token_id = last
        elif not self._params.ignore_eos and last in self._eos:
            self.final.eos_token_id = last
        else:
            return False
        self.final.finish_reason = _STOP
        return True

    def flush(self) -> generation_pb2.GenerateResponse | None:
        """At the end: the text held back (an incomplete character, a possible stop
        string's start), if any; completes the Final's usage."""
        tail = ""
        if not self.final.stop_string:
            tail = self._match(self._detok.flush(), final_piece=True)
        self.final.usage.completion_tokens = len(self.generated)
        if self.final.stop_string:
            self.final.finish_reason = _STOP
        self.count()
        if not tail:
            return None
        return generation_pb2.GenerateResponse(chunk=generation_pb2.Chunk(text=tail))

    def count(self) -> None:
        """Give the counter the tokens it has not been given yet."""
        if self._uncounted:
            self._count(self._uncounted)
            self._uncounted = 0

    def _match(self, text: str, final_piece: bool = False) -> str:
        if self._matcher is None or self.final.stop_string:
            return text
        r = self._matcher.push(text)
        if r.stop is not None:
            self.final.stop_string = r.stop
            return r.text
        return r.text + (self._matcher.flush() if final_piece else "")

    def _cut_at_stop(self, ids: list[int]) -> list[int]:
        """The chunk's ids up to the token that completed the stop string; later ones were
        generated but are not part of the answer (nor of the usage)."""
        if len(ids) <= 1:
            return ids
        base = len(self.generated) - len(ids)
        decode = self._tokenizer.decode
        stop = self.final.stop_string
        for k in range(1, len(ids)):
            if stop in decode(self.generated[: base + k], self._params.skip_special_tokens):
                del self.generated[base + k :]
                return ids[:k]
        return ids

    def _copy_logprobs(
        self,
        into: RepeatedCompositeFieldContainer[common_pb2.TokenLogprob],
        src: Sequence[common_pb2.TokenLogprob],
    ) -> None:
        """Into a chunk's (repeated) logprobs, with each alternative's text filled in."""
        into.extend(src)
        decode = self._tokenizer.decode
        for lp in into:
            for top in lp.top:
                top.token = decode([top.token_id], False)
