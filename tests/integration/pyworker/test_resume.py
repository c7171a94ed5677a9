"""A resumed request on the vLLM worker (`resume_token_ids`), against the real engine: the
engine continues after the tokens so far, a constraint continues where the output left
off (its grammar advanced past them), usage counts only what is new, a seeded resume is
reproducible, and what cannot continue is refused naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from bench.cpu.constraints import CASES, Checker
from tests.integration.pyworker.test_worker import (
    PROMPT,
    bad_request_fields,
    generate,
    ids_of,
    request,
)

pytestmark = pytest.mark.engine

CONSTRAINED = dict(sampling={"temperature": 1.0, "seed": 7}, max_tokens=160)


def test_info_says_it_takes_resumes_of_every_constraint_kind(stub: Any) -> None:
    caps = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10).capabilities
    assert caps.resume_tokens
    assert sorted(caps.resumable_constraints) == sorted(caps.structured_output)
    assert len(caps.resumable_constraints) == 5


def test_a_resumed_request_continues_and_counts_only_new_tokens(stub: Any) -> None:
    whole_chunks, _ = generate(
        stub, request(sampling={"temperature": 0.0}, max_tokens=12, ignore_eos=True)
    )
    whole = ids_of(whole_chunks)
    chunks, final = generate(
        stub,
        request(
            sampling={"temperature": 0.0},
            max_tokens=8,
            ignore_eos=True,
            resume_token_ids=whole[:4],
        ),
    )
    assert ids_of(chunks) == whole[4:]  # greedy: the same continuation as one run
    assert final.usage.prompt_tokens == len(PROMPT)
    assert final.usage.completion_tokens == 8
    assert final.usage.cached_prompt_tokens <= len(PROMPT)


def test_a_seeded_resume_is_reproducible(stub: Any) -> None:
    req = request(
        sampling={"temperature": 1.0, "seed": 11},
        max_tokens=10,
        ignore_eos=True,
        resume_token_ids=[50, 51, 52],
    )
    first, _ = generate(stub, req)
    again, _ = generate(stub, req)
    assert ids_of(first) == ids_of(again)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.kind)
def test_a_constraint_continues_past_the_tokens_so_far(
    stub: Any, case: Any, tiny_model_dir: Path
) -> None:
    checker = Checker(tiny_model_dir, any_whitespace=True)  # the session worker's setting
    whole_chunks, _ = generate(stub, request(constraint=case.to_proto(), **CONSTRAINED))
    whole = ids_of(whole_chunks)
    assert len(whole) >= 4, whole
    cut = len(whole) // 2
    chunks, final = generate(
        stub,
        request(
            constraint=case.to_proto(),
            resume_token_ids=whole[:cut],
            **{**CONSTRAINED, "max_tokens": 160 - cut},
        ),
    )
    ids = whole[:cut] + ids_of(chunks)
    assert final.usage.completion_tokens == len(ids) - cut
    assert final.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    stopped = final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert checker.violation(case, _decode(tiny_model_dir, ids), ids, stopped) is None


def test_a_constraint_that_cannot_continue_is_refused(stub: Any, tiny_model_dir: Path) -> None:
    regex = next(c for c in CASES if c.kind == "regex")
    # "{" can never start an output of that regex.
    brace = _encode(tiny_model_dir, "{")
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, request(constraint=regex.to_proto(), resume_token_ids=brace, **CONSTRAINED))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "resume_token_ids" in (e.value.details() or "")


def test_bad_resume_tokens_name_the_field(stub: Any) -> None:
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, request(resume_token_ids=[3, 100000]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(e.value) == ["resume_token_ids[1]"]
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, request(beam_width=2, resume_token_ids=[3], sampling={"temperature": 0.0}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume_token_ids" in bad_request_fields(e.value)


def _decode(model_dir: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(str(model_dir)).decode(ids, skip_special_tokens=True))


def _encode(model_dir: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode(text, add_special_tokens=False)
    return [int(t) for t in ids]


def test_the_workers_own_check_catches_a_broken_constraint(tiny_model_dir: Path) -> None:
    """ResumeGuard over vLLM's own xgrammar grammar: a token the constraint forbids, or a
    stop where it cannot end, is caught; a valid output passes."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    from pyworker.resume_grammar import ResumeGuard

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))

    def guard() -> ResumeGuard:
        ctx = compiler.compile_regex("ab+c")
        matcher = xgr.GrammarMatcher(ctx)
        return ResumeGuard(XgrammarGrammar(vocab_size=len(tokenizer), matcher=matcher, ctx=ctx))

    def ids(text: str) -> list[int]:
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    ok = guard()
    ok.feed([*ids("abbc"), tokenizer.eos_token_id])
    assert ok.check_end(stopped=True) is None
    short = guard()
    short.feed(ids("abb"))
    assert short.check_end(stopped=False) is None  # cut by max_tokens: a valid start
    assert "cannot end" in (short.check_end(stopped=True) or "")
    wrong = guard()
    wrong.feed(ids("ax"))
    assert "does not allow" in (wrong.check_end(stopped=False) or "")
