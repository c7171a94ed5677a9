"""Capabilities: each worker declares what its engine can do; ListModels shows it, and
the control plane refuses what a model's engine cannot do before any worker is called,
naming the field and the engine."""

from __future__ import annotations

import re

import pytest

from switchyard.client import Client, FailedPrecondition, InvalidArgument
from tests.procs import Proc


@pytest.fixture(scope="module")
def plane(vllm_and_sim: Proc) -> Proc:
    return vllm_and_sim


def test_list_models_shows_what_each_engine_can_do(plane: Proc) -> None:
    import grpc
    from switchyard.v1 import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(plane.address) as ch:
        models = generation_pb2_grpc.GenerationStub(ch).ListModels(
            generation_pb2.ListModelsRequest(), timeout=10
        )
    caps = {m.name: m.capabilities for m in models.models}
    assert caps["tiny"].max_logprobs == 20 and caps["sim"].max_logprobs == 0
    # The control plane fans n out, the same on every engine
    # (tests/integration/control/test_samples.py).
    assert caps["tiny"].max_n == caps["sim"].max_n == 16
    assert list(caps["tiny"].structured_output) == [
        "choice", "grammar", "json_object", "json_schema", "regex",
    ]  # fmt: skip
    assert not caps["sim"].structured_output
    # vLLM's beam search asks 2 x width log probabilities a step, within max_logprobs.
    assert caps["tiny"].beam_search and caps["tiny"].max_beam_width == 10
    assert not caps["sim"].beam_search and caps["sim"].max_beam_width == 0


def test_structured_output_on_an_engine_without_it_is_refused_first(plane: Proc) -> None:
    with Client(plane.address, timeout=30) as client:
        for kind, value in (("regex", "[a-z]+"), ("choice", ["a", "b"]), ("json_object", True)):
            with pytest.raises(FailedPrecondition) as refused:
                client.complete("sim", "Hello", max_tokens=2, **{kind: value})
            assert [v.field for v in refused.value.violations] == [f"constraint.{kind}"]
            assert "(sim switchyard-sim 1)" in refused.value.message
        out = client.complete("tiny", "Hi", max_tokens=8, regex="[a-c]{3}", temperature=1.0)
        assert re.fullmatch("[a-c]{3}", out.text), out.text


def test_what_an_engine_lacks_is_refused_before_any_worker_naming_field_and_engine(
    plane: Proc,
) -> None:
    with Client(plane.address, timeout=30) as client:
        with pytest.raises(FailedPrecondition) as missing:
            client.complete("sim", "Hello", max_tokens=2, logprobs=3)
        assert [v.field for v in missing.value.violations] == ["output.logprobs"]
        assert "'sim' (sim switchyard-sim 1)" in missing.value.message
        # The same request on an engine that has it.
        out = client.complete("tiny", "Hello", max_tokens=2, ignore_eos=True, logprobs=3)
        assert len(out.logprobs) == 2 and all(len(lp.top) >= 3 for lp in out.logprobs)
        # The sampled token's own log probability is what the simulator has.
        out = client.complete("sim", "Hello", max_tokens=2, ignore_eos=True, logprobs=0)
        assert len(out.logprobs) == 2
        # Beyond what every engine takes: the same answer everywhere, before capabilities.
        for model in ("tiny", "sim"):
            with pytest.raises(InvalidArgument) as bad:
                client.complete(model, "Hello", max_tokens=2, logprobs=21)
            assert [v.field for v in bad.value.violations] == ["output.logprobs"]


def test_prompt_logprobs_come_in_the_first_chunk_where_the_engine_has_them(plane: Proc) -> None:
    with Client(plane.address, timeout=60) as client:
        prompt = client.tokenize("tiny", "Which track to Leeds").token_ids
        done = client.complete("tiny", prompt, max_tokens=1, ignore_eos=True, temperature=0,
                               logprobs=0, prompt_logprobs=3)  # fmt: skip
        assert [lp.token_id for lp in done.prompt_logprobs] == list(prompt[1:])
        assert all(len(lp.top) == 3 and all(text for _, text, _ in lp.top)
                   for lp in done.prompt_logprobs)  # fmt: skip
        # The engine's view of a token is the same whether it sampled it or was given it:
        # the generated token's logprob is its prompt logprob one request later.
        token = done.token_ids[0]
        again = client.complete("tiny", [*prompt, token], max_tokens=1, ignore_eos=True,
                                prompt_logprobs=0)  # fmt: skip
        assert again.prompt_logprobs[-1].token_id == token
        assert abs(again.prompt_logprobs[-1].logprob - done.logprobs[0].logprob) < 1e-3
        chunks = list(client.generate("tiny", prompt, max_tokens=4, ignore_eos=True,
                                      prompt_logprobs=1))  # fmt: skip
        assert len(chunks[0].prompt_logprobs) == len(prompt) - 1
        assert not any(c.prompt_logprobs for c in chunks[1:])
        with pytest.raises(FailedPrecondition) as refused:
            client.complete("sim", "Hello", max_tokens=2, prompt_logprobs=0)
        assert [v.field for v in refused.value.violations] == ["output.prompt_logprobs"]
        with pytest.raises(InvalidArgument) as bad:
            client.complete("tiny", "Hello", max_tokens=2, prompt_logprobs=21)
        assert [v.field for v in bad.value.violations] == ["output.prompt_logprobs"]
