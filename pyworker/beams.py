"""Beam search on vLLM: its own online beam search (`BeamSearchOnlineMixin`, in
`vllm.entrypoints.generate.beam_search.online` in 0.26 and 0.32), over the worker's
AsyncLLM. Each step asks the engine for 2 x width alternatives of every live beam (one
one-token request per beam, sharing the prompt's cached blocks) and keeps the best
`width`; the search ends a beam at the tokenizer's EOS or at max_tokens, and answers
once, at the end. Cancelling the task that awaits it aborts the step's requests.
"""

from __future__ import annotations

from typing import Any

from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from pyworker.errors import EngineFailure

MAX_BEAM_WIDTH = 16  # as the control plane takes


def _mixin() -> Any:
    try:
        from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    except ImportError:  # a release without it: no beam search
        return None
    return BeamSearchOnlineMixin


def max_beam_width(max_logprobs: int, has_tokenizer: bool) -> int:
    """The widest search the engine can run: each step asks for 2 x width log
    probabilities, within the engine's max_logprobs; 0 without the search or without a
    tokenizer (it reads the EOS from the tokenizer)."""
    if not has_tokenizer or _mixin() is None:
        return 0
    if max_logprobs < 0:  # vLLM's -1: no cap on log probabilities
        return MAX_BEAM_WIDTH
    width = min(max_logprobs // 2, MAX_BEAM_WIDTH)
    return width if width >= 2 else 0


def _searcher(llm: Any) -> Any:
    mixin = _mixin()
    if mixin is None:
        raise EngineFailure("this vLLM release has no beam search")

    class Search(mixin):  # type: ignore[misc,valid-type]
        """The mixin's two attributes, from the worker's engine."""

        def __init__(self) -> None:
            self.engine_client = llm
            self.renderer = llm.renderer

    return Search()


async def search(
    llm: Any,
    prompt: Any,
    request_id: str,
    width: int,
    sampling: Any,
    lora_request: Any,
    trace_headers: Any = None,
) -> Any:
    """Run the search (`sampling`: the request's vLLM SamplingParams, for max_tokens,
    ignore_eos and temperature); a worker Final with every beam (usage and timing left
    to fill)."""
    from vllm.sampling_params import BeamSearchParams

    params = BeamSearchParams(
        beam_width=width,
        max_tokens=int(sampling.max_tokens),
        ignore_eos=bool(sampling.ignore_eos),
        temperature=float(sampling.temperature or 0.0),
    )
    result: Any = None
    async for out in _searcher(llm).beam_search(
        prompt, request_id, params, lora_request=lora_request, trace_headers=trace_headers
    ):
        result = out
    if result is None:
        raise EngineFailure("the beam search ended without an answer")
    return final_of(result.outputs, eos_of(llm))


def eos_of(llm: Any) -> int | None:
    """The EOS the search stops at: the tokenizer's."""
    eos = getattr(llm.renderer.get_tokenizer(), "eos_token_id", None)
    return int(eos) if eos is not None else None


def final_of(outputs: list[Any], eos: int | None) -> Any:
    """The beams of a finished search. A beam that ended at the EOS gets it back among
    its tokens, as a sampled answer has it."""
    final = worker_pb2.Final()
    for o in outputs:
        reason = str(o.finish_reason or "length")
        if reason == "error":
            raise EngineFailure("the engine failed a step of the beam search")
        if reason == "abort":
            final.finish_reason = common_pb2.FINISH_REASON_CANCELLED
            del final.beams[:]
            return final
        ids = [int(t) for t in o.token_ids]
        beam = final.beams.add(cumulative_logprob=float(o.cumulative_logprob or 0.0))
        if reason == "stop" and eos is not None:
            if not ids or ids[-1] != eos:
                ids.append(eos)
            beam.finish_reason = common_pb2.FINISH_REASON_STOP
            beam.eos_token_id = eos
        else:
            beam.finish_reason = common_pb2.FINISH_REASON_LENGTH
        beam.token_ids.extend(ids)
    final.finish_reason = (
        final.beams[0].finish_reason if final.beams else common_pb2.FINISH_REASON_LENGTH
    )
    final.usage.completion_tokens = sum(len(b.token_ids) for b in final.beams)
    return final
