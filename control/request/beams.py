"""Beam search (`GenerateRequest.beam_width`): one engine request, whose worker Final
carries every beam. Here they become the answer's choices, ranked the same way whichever
engine searched: by cumulative log probability per generated token, best first (index 0).
Each beam goes out as one Chunk with its whole text, then its Final with its own finish
reason, usage and cumulative_logprob; the last Final carries the usage of all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from switchyard.v1 import common_pb2, generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.text.tokenizer import Tokenizer


def _score(beam: worker_pb2.Beam) -> float:
    return beam.cumulative_logprob / max(1, len(beam.token_ids))


def ranked(beams: Sequence[worker_pb2.Beam]) -> list[worker_pb2.Beam]:
    """Best first; ties keep the engine's order."""
    return sorted(beams, key=_score, reverse=True)


def beam_responses(
    tokenizer: Tokenizer,
    context_ids: Sequence[int],
    skip_special_tokens: bool,
    final: generation_pb2.Final,
    beams: Sequence[worker_pb2.Beam],
) -> list[generation_pb2.GenerateResponse]:
    """The public messages of a finished beam search; `final` is the request's Final as
    filled so far (timing, worker, engine), `context_ids` the prompt's last tokens (for
    the first word's spacing, as a streamed answer gets it)."""
    total = common_pb2.Usage(
        prompt_tokens=final.usage.prompt_tokens,
        cached_prompt_tokens=final.usage.cached_prompt_tokens,
    )
    out: list[generation_pb2.GenerateResponse] = []
    for i, beam in enumerate(ranked(beams)):
        ids = list(beam.token_ids)
        detok = tokenizer.detokenizer(list(context_ids), skip_special_tokens)
        text = detok.push(ids) + detok.flush()
        out.append(
            generation_pb2.GenerateResponse(
                chunk=generation_pb2.Chunk(text=text, token_ids=ids, index=i)
            )
        )
        f = generation_pb2.Final()
        f.CopyFrom(final)
        f.index = i
        f.finish_reason = beam.finish_reason
        f.ClearField("stop_reason")
        if beam.HasField("eos_token_id"):
            f.eos_token_id = beam.eos_token_id
        f.usage.completion_tokens = len(ids)
        f.cumulative_logprob = beam.cumulative_logprob
        total.completion_tokens += len(ids)
        out.append(generation_pb2.GenerateResponse(final=f))
    if out:
        out[-1].final.total_usage.CopyFrom(total)
    return out
