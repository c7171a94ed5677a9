"""Beam search (`beam_width`): on the real vLLM worker, through its engine's own search;
the beams are the answer's choices, best first, each scored by its cumulative log
probability; refused, naming the field, on an engine without it and with what it does
not take."""

from __future__ import annotations

import math

import pytest

from switchyard.client import Client, FailedPrecondition, InvalidArgument
from tests.procs import Proc

LONG = {"max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def plane(vllm_and_sim: Proc) -> Proc:
    return vllm_and_sim


def _score(choice: object) -> float:
    final = choice.final  # type: ignore[attr-defined]
    return float(final.cumulative_logprob) / max(1, len(choice.token_ids))  # type: ignore[attr-defined]


def test_beams_are_the_choices_best_first_with_true_scores(plane: Proc) -> None:
    with Client(plane.address, timeout=120) as client:
        prompt = client.tokenize("tiny", "Which track to Leeds").token_ids
        out = client.complete("tiny", prompt, beam_width=3, **LONG)
        again = client.complete("tiny", prompt, beam_width=3, **LONG)
        greedy = client.complete("tiny", prompt, temperature=0, logprobs=0, **LONG)
        # Each beam's score is what the model gives its tokens: their log probabilities
        # as prompt tokens, one request later.
        checks = [
            client.complete("tiny", [*prompt, *c.token_ids], max_tokens=1, prompt_logprobs=0)
            for c in out.choices
        ]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.token_ids for c in out.choices}) == 3, "the beams are distinct"
    assert all(len(c.token_ids) == 6 and c.final.finish_reason == "length" for c in out.choices)
    scores = [_score(c) for c in out.choices]
    assert scores == sorted(scores, reverse=True), scores
    for choice, check in zip(out.choices, checks, strict=True):
        own = check.prompt_logprobs[len(prompt) - 1 :]
        assert [lp.token_id for lp in own] == list(choice.token_ids)
        total = sum(lp.logprob for lp in own)
        assert choice.final.cumulative_logprob is not None
        assert math.isclose(choice.final.cumulative_logprob, total, abs_tol=0.05), (
            choice.final.cumulative_logprob,
            total,
        )
    # A search of three beams does at least as well as the greedy path, and the same on
    # every call.
    assert (
        out.choices[0].final.cumulative_logprob >= sum(lp.logprob for lp in greedy.logprobs) - 1e-3
    )
    assert [c.token_ids for c in again.choices] == [c.token_ids for c in out.choices]
    # The top of the answer is the best beam; usage counts every beam, the prompt once.
    assert out.text == out.choices[0].text and out.token_ids == out.choices[0].token_ids
    assert out.final.total_usage is not None
    assert out.final.total_usage.completion_tokens == 18
    assert out.final.total_usage.prompt_tokens == len(prompt)
    assert greedy.final.cumulative_logprob is None


def test_streamed_beams_arrive_whole_at_the_end(plane: Proc) -> None:
    with Client(plane.address, timeout=120) as client:
        whole = client.complete("tiny", "Hello there", beam_width=2, **LONG)
        stream = client.generate("tiny", "Hello there", beam_width=2, **LONG)
        with stream:
            chunks = list(stream)
    assert [c.index for c in chunks] == [0, 1]
    assert [c.text for c in chunks] == [c.text for c in whole.choices]
    assert [c.token_ids for c in chunks] == [c.token_ids for c in whole.choices]
    assert [f.index for f in stream.finals] == [0, 1]
    assert [f.total_usage is not None for f in stream.finals] == [False, True]


def test_beam_search_is_refused_where_it_does_not_apply(plane: Proc) -> None:
    with Client(plane.address, timeout=60) as client:
        with pytest.raises(FailedPrecondition) as missing:
            client.complete("sim", "Hello", beam_width=2, max_tokens=4)
        assert [v.field for v in missing.value.violations] == ["beam_width"]
        assert "'sim' (sim switchyard-sim 1) has no beam search" in missing.value.message
        with pytest.raises(InvalidArgument) as wide:
            client.complete("tiny", "Hello", beam_width=11, max_tokens=4)
        assert [v.field for v in wide.value.violations] == ["beam_width"]
        for options, field in (
            ({"n": 2}, "n"),
            ({"temperature": 0.7}, "sampling.temperature"),
            ({"seed": 3}, "sampling.seed"),
            ({"stop": ["x"]}, "stopping.stop"),
            ({"stop_token_ids": [5]}, "stopping.stop_token_ids"),
            ({"min_tokens": 2}, "stopping.min_tokens"),
            ({"logprobs": 1}, "output.logprobs"),
            ({"regex": "[a-z]+"}, "constraint.regex"),
            ({"beam_width": 17}, "beam_width"),
        ):
            with pytest.raises(InvalidArgument) as bad:
                client.complete("tiny", "Hello", max_tokens=4, **{"beam_width": 2, **options})
            assert [v.field for v in bad.value.violations] == [field], options
        # Temperature 0 is what beam search does anyway.
        ok = client.complete("tiny", "Hello", beam_width=2, temperature=0, **LONG)
        assert len(ok.choices) == 2
