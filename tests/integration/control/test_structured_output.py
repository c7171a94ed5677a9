"""Structured output through the control plane on the real vLLM CPU worker (the tiny model,
whose random weights would write anything): every output satisfies its constraint, over
many seeds, streamed or whole. Bad constraints name the field. (An engine that takes none
is refused before any worker is called: tests/integration/control/test_capabilities.py.)

The worker here is started as an operator who wants compact JSON would start it, with
vLLM's `structured_outputs_config: {backend: xgrammar, disable_any_whitespace: true}`:
with whitespace allowed, the tiny model's random choices fill any length with it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
from switchyard.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from switchyard.client import Client, InvalidArgument
from switchyard.client.errors import from_rpc_error
from tests.procs import Proc, serving_control

SEEDS = range(12)
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["colour", "ok", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def plane(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    settings = (
        '{"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": true}}'
    )
    models = f"  - {{name: tiny, engine: vllm, model: {tiny_model_dir}, engine_args: {settings}}}\n"
    with serving_control(tmp_path_factory.mktemp("structured"), models, "tiny") as p:
        yield p


def outputs(client: Client, seed: int, **constraint: Any) -> tuple[str, str]:
    """The whole answer (Complete) and the streamed one (Generate) for one seed."""
    options = {"max_tokens": 96, "temperature": 1.0, "seed": seed, **constraint}
    whole = client.complete("tiny", "Answer:", **options)
    assert whole.final.finish_reason == "stop", whole
    streamed = "".join(c.text for c in client.generate("tiny", "Answer:", **options))
    return whole.text, streamed


def test_json_schema_outputs_validate_over_seeds(plane: Proc) -> None:
    with Client(plane.address, timeout=120) as client:
        for seed in SEEDS:
            whole, streamed = outputs(client, seed, json_schema=SCHEMA)
            jsonschema.validate(json.loads(whole), SCHEMA)
            assert streamed == whole  # the same seed: the same constrained answer


def test_regex_choice_and_grammar_outputs_satisfy_them_over_seeds(plane: Proc) -> None:
    pattern = r"[a-c]{3}-[0-9]{2}"
    choices = ["yes", "no", "it depends"]
    seen: set[str] = set()
    with Client(plane.address, timeout=120) as client:
        for seed in SEEDS:
            whole, streamed = outputs(client, seed, regex=pattern)
            assert re.fullmatch(pattern, whole) and streamed == whole, (seed, whole)
            whole, streamed = outputs(client, seed, choice=choices)
            assert whole in choices and streamed == whole, (seed, whole)
            seen.add(whole)
            whole, streamed = outputs(client, seed, grammar='root ::= "up" | "down" [0-9]')
            assert re.fullmatch(r"up|down[0-9]", whole) and streamed == whole, (seed, whole)
    assert len(seen) > 1  # sampled, not a fixed answer: the constraint did the work


def test_json_object_outputs_are_objects(plane: Proc) -> None:
    # Any object: the tiny model's strings may run past max_tokens, so only those that
    # ended are parsed; some must end.
    ended = 0
    with Client(plane.address, timeout=120) as client:
        for seed in SEEDS:
            out = client.complete("tiny", "Answer:", max_tokens=96, seed=seed, json_object=True)
            if out.final.finish_reason == "stop":
                assert isinstance(json.loads(out.text), dict), out.text
                ended += 1
            else:
                assert out.text.startswith("{")
    assert ended > 0


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        (common_pb2.OutputConstraint(json_schema='{"type": "object",'), "constraint.json_schema"),
        (common_pb2.OutputConstraint(json_schema='{"type": "objekt"}'), "constraint.json_schema"),
        (common_pb2.OutputConstraint(json_schema="[1, 2]"), "constraint.json_schema"),
        (common_pb2.OutputConstraint(regex="([a-z]"), "constraint.regex"),
        (common_pb2.OutputConstraint(json_object=False), "constraint.json_object"),
        (common_pb2.OutputConstraint(choice=common_pb2.Choices()), "constraint.choice.values"),
        (
            common_pb2.OutputConstraint(choice=common_pb2.Choices(values=["a", ""])),
            "constraint.choice.values[1]",
        ),
        (common_pb2.OutputConstraint(grammar="  "), "constraint.grammar"),
        (common_pb2.OutputConstraint(), "constraint"),
        # Only the engine can judge a grammar: the worker's refusal names the field too.
        (common_pb2.OutputConstraint(grammar="root ::= ("), "constraint.grammar"),
    ],
)
def test_bad_constraints_name_the_field(
    plane: Proc, constraint: common_pb2.OutputConstraint, field: str
) -> None:
    req = generation_pb2.GenerateRequest(
        model="tiny", text="Hi", stopping=generation_pb2.StoppingParams(max_tokens=4)
    )
    req.constraint.CopyFrom(constraint)
    with grpc.insecure_channel(plane.address) as ch, pytest.raises(grpc.RpcError) as e:
        generation_pb2_grpc.GenerationStub(ch).Complete(req, timeout=60)
    bad = from_rpc_error(e.value)
    assert isinstance(bad, InvalidArgument), bad
    assert [v.field for v in bad.violations] == [field], bad.violations
