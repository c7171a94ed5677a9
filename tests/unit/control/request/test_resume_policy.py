"""What the control plane sends a worker that resumes a stream (control/request/resume.py):
the tokens so far apart from the prompt where the worker takes them (in the prompt for a
worker from before), a seed derived from the seed and the point of the resume, no prompt
logprobs; and which workers may continue a constrained stream."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from switchyard.v1 import generation_pb2
from switchyard.worker.v1 import worker_pb2

from control.request.attempts import build_worker_request
from control.request.prepare import PreparedRequest
from control.request.resume import can_resume, resume_request, resume_seed
from control.text.params import parse_request
from control.workers.state import Capabilities


def params(**fields: Any) -> Any:
    req = generation_pb2.GenerateRequest(model="m", text="hi", **fields)
    return parse_request(req)


def worker(caps: Capabilities | None) -> Any:
    return SimpleNamespace(info=SimpleNamespace(capabilities=caps))


NEW = Capabilities(resume_tokens=True, resumable_constraints=frozenset({"regex", "choice"}))


def resumed(p: Any, w: Any, prompt: list[int], so_far: list[int]) -> worker_pb2.GenerateRequest:
    prepared = PreparedRequest(SimpleNamespace(), p, tuple(prompt), 10, 0.0, None)  # type: ignore[arg-type]
    wreq = build_worker_request(prepared, 10, 0)
    resume_request(wreq, w, prompt, so_far, p)
    return wreq


def test_the_tokens_so_far_travel_apart_from_the_prompt() -> None:
    p = params(output=generation_pb2.OutputOptions(prompt_logprobs=2))
    wreq = resumed(p, worker(NEW), [1, 2, 3], [7, 8])
    assert list(wreq.prompt_token_ids) == [1, 2, 3]
    assert list(wreq.resume_token_ids) == [7, 8]
    assert not wreq.HasField("prompt_logprobs")  # the caller has them from the first worker


def test_a_worker_from_before_gets_them_at_the_end_of_its_prompt() -> None:
    for old in (worker(None), worker(Capabilities())):
        wreq = resumed(params(), old, [1, 2, 3], [7, 8])
        assert list(wreq.prompt_token_ids) == [1, 2, 3, 7, 8]
        assert not wreq.resume_token_ids


def test_a_seeded_resume_samples_with_a_seed_of_the_seed_and_the_point() -> None:
    p = params(sampling={"seed": 42})
    at_5 = resumed(p, worker(NEW), [1], [9] * 5).sampling.seed
    assert at_5 == resume_seed(42, 5) == resumed(p, worker(NEW), [1], [4] * 5).sampling.seed
    assert at_5 not in (42, resume_seed(42, 6), resume_seed(43, 5))
    assert resume_seed(42, 0) == 42  # the first attempt is the caller's own seed
    assert 0 <= resume_seed(2**64 - 1, 3) < 2**64
    assert not resumed(params(), worker(NEW), [1], [9]).sampling.HasField("seed")


def test_a_constrained_stream_resumes_only_where_its_kind_continues() -> None:
    regex = params(constraint={"regex": "[a-z]+"})
    schema = params(constraint={"json_schema": '{"type": "object"}'})
    assert can_resume(worker(NEW), regex)
    assert not can_resume(worker(NEW), schema)
    assert not can_resume(worker(None), regex)  # declares nothing: assumed unable
    assert not can_resume(SimpleNamespace(info=None), regex)  # type: ignore[arg-type]
    assert can_resume(worker(None), params())  # free text resumes anywhere
