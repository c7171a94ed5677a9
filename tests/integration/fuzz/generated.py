"""Generated public requests (hypothesis strategies) and the check every answer must pass.

A request may set any field to anything the wire allows: out-of-range and non-finite
numbers, empty and huge text, token ids outside the vocabulary, many and long stop
strings, reused request ids. A call may be cancelled after any number of messages or
given a short deadline. Whatever is sent, the answer is a normal stream (chunks, then
exactly one final, last) or a status with a clear message: INVALID_ARGUMENT names the
fields in a BadRequest; client input never gets UNKNOWN or INTERNAL.

How many examples run is a setting: SWITCHYARD_FUZZ_EXAMPLES (CI runs a few hundred;
docs/development.md, "Fuzzing and the soak", has the full run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from hypothesis import strategies as st
from switchyard.v1 import common_pb2, generation_pb2

from control.text.params import MAX_PROMPT_CHARS


def examples(default: int) -> int:
    """The number of generated cases: SWITCHYARD_FUZZ_EXAMPLES scales every fuzz test
    (its value is the count for the public-API fuzz on simulator workers)."""
    full = int(os.environ.get("SWITCHYARD_FUZZ_EXAMPLES", "0"))
    return max(default, full * default // 300) if full else default


# Codes a client may see for anything it sends; INTERNAL and UNKNOWN are never its fault.
CLIENT_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        # What the model's engine lacks (capabilities), named as a field.
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)

_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-3, max_value=3),
    st.sampled_from([0.0, 1.0, -1.0, 2.0, 1e-9]),
)
_texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "Hello", "🚂🚃🚄", "\x00\n\t", "a" * 5000]),
    st.just("x" * (MAX_PROMPT_CHARS + 1)),
)
_ids = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=12)


@st.composite
def sampling(draw: st.DrawFn, wild: bool) -> common_pb2.SamplingParams:
    """Sampling values in range, or (wild) anything the wire carries."""
    s = common_pb2.SamplingParams()
    floats = _numbers if wild else st.floats(min_value=0.05, max_value=1.0)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if draw(st.booleans()):
            setattr(s, name, draw(floats))
    for name in ("presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(s, name, draw(_numbers if wild else st.floats(-2, 2)))
    if draw(st.booleans()):
        top_k = st.integers(-(2**31), 2**31 - 1) if wild else st.integers(-1, 50)
        s.top_k = draw(top_k)
    if draw(st.booleans()):
        s.seed = draw(st.integers(min_value=0, max_value=2**64 - 1))
    return s


@st.composite
def valid_stopping(draw: st.DrawFn) -> generation_pb2.StoppingParams:
    p = generation_pb2.StoppingParams(max_tokens=draw(st.integers(1, 12)))
    if draw(st.booleans()):
        p.min_tokens = draw(st.integers(0, p.max_tokens))
    p.stop.extend(draw(st.lists(st.text(min_size=1, max_size=4), max_size=3)))
    p.stop_token_ids.extend(draw(st.lists(st.integers(0, 511), max_size=4)))
    p.ignore_eos = draw(st.booleans())
    p.include_stop_str_in_output = draw(st.booleans())
    return p


@st.composite
def constraints(draw: st.DrawFn) -> common_pb2.OutputConstraint:
    """Structured-output constraints, good and bad, of every kind (and of none). Regexes
    come without counted repetition: what a large count costs an engine's compiler is
    not what this fuzzes."""
    c = common_pb2.OutputConstraint()
    kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "choice", "grammar", ""]))
    if kind == "json_schema":
        c.json_schema = draw(
            st.sampled_from(
                ['{"type": "object"}', '{"enum": ["a", "b"]}', "{", "[]", '{"type": "nope"}', ""]
            )
        )
    elif kind == "json_object":
        c.json_object = draw(st.booleans())
    elif kind == "regex":
        c.regex = draw(st.text(alphabet="abc()[]*+?|.\\", max_size=12))
    elif kind == "choice":
        c.choice.values.extend(draw(st.lists(st.text(max_size=6), max_size=4)))
    elif kind == "grammar":
        c.grammar = draw(st.sampled_from(['root ::= "a" | "b"', "root ::= (", "", " "]))
    return c


def _mutations(r: generation_pb2.GenerateRequest, draw: st.DrawFn) -> None:
    """Set one field to something wild."""
    which = draw(st.integers(0, 16))
    if which == 0:
        r.model = draw(st.sampled_from(["", "no-such-model", "x" * 300]))
    elif which == 1:
        r.text = draw(_texts)
    elif which == 2:
        r.token_ids.ids[:] = draw(_ids)
    elif which == 3:
        r.ClearField("prompt")
    elif which == 4:
        r.sampling.CopyFrom(draw(sampling(wild=True)))
    elif which == 5:
        r.stopping.max_tokens = draw(st.one_of(st.just(0), st.integers(0, 2**32 - 1)))
    elif which == 6:
        r.stopping.ClearField("max_tokens")  # up to the context
    elif which == 7:
        r.stopping.min_tokens = draw(st.integers(0, 2**32 - 1))
    elif which == 8:
        r.stopping.stop[:] = draw(
            st.one_of(
                st.lists(st.text(min_size=200, max_size=300), max_size=20),
                st.just([""] * 3000),
            )
        )
    elif which == 9:
        r.stopping.stop_token_ids[:] = draw(st.one_of(_ids, st.just(list(range(200)))))
    elif which == 10:
        r.output.logprobs = draw(st.integers(0, 2**32 - 1))
    elif which == 11:
        r.constraint.CopyFrom(draw(constraints()))
    elif which == 12:
        r.output.prompt_logprobs = draw(st.integers(0, 2**32 - 1))
    elif which == 13:
        r.n = draw(st.one_of(st.integers(0, 20), st.just(2**32 - 1)))
    elif which == 14:  # a LoRA adapter: none is loaded, or the name is not one
        r.adapter = draw(st.one_of(st.sampled_from(["tenant-a", "x" * 65, "a b"]), st.text()))
    elif which == 15:  # beam search, often with what it does not take
        r.beam_width = draw(st.one_of(st.integers(0, 20), st.just(2**32 - 1)))
    else:
        r.request_id = draw(st.text(min_size=100, max_size=300))


@st.composite
def requests(draw: st.DrawFn, model: str) -> generation_pb2.GenerateRequest:
    """Mostly requests a client means (so that streams run, overlap and get cancelled),
    with one to three fields set to anything the wire carries in a third of them."""
    r = generation_pb2.GenerateRequest(model=model)
    if draw(st.integers(0, 3)):
        r.text = draw(
            st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["Hello", "🚂🚃🚄"]))
        )
    else:
        r.token_ids.ids.extend(draw(st.lists(st.integers(2, 511), min_size=1, max_size=8)))
    if draw(st.booleans()):
        r.sampling.CopyFrom(draw(sampling(wild=False)))
    r.stopping.CopyFrom(draw(valid_stopping()))
    if draw(st.booleans()):
        r.output.logprobs = draw(st.integers(0, 5))
    if draw(st.booleans()):
        r.output.skip_special_tokens = draw(st.booleans())
    r.request_id = draw(st.sampled_from(["", "", "dup", "dup2", "another"]))
    r.priority = draw(st.integers(min_value=-(2**31), max_value=2**31 - 1))
    if draw(st.integers(0, 4)) == 0:
        r.n = draw(st.integers(0, 3))
    if draw(st.integers(0, 2)) == 0:
        for _ in range(draw(st.integers(1, 3))):
            _mutations(r, draw)
    return r


@dataclass(frozen=True)
class Plan:
    """How the client treats one call: cancel after `cancel_after` messages (None: read
    to the end) and its deadline in seconds."""

    request: generation_pb2.GenerateRequest
    cancel_after: int | None
    timeout_s: float


@st.composite
def plans(draw: st.DrawFn, model: str) -> Plan:
    return Plan(
        request=draw(requests(model)),
        cancel_after=draw(st.one_of(st.none(), st.integers(0, 4))),
        timeout_s=draw(st.sampled_from([0.001, 0.05, 30.0, 30.0, 30.0])),
    )


def run(stub: Any, plan: Plan) -> str:
    """Make the call; check the answer; return how it ended (for the statistics)."""
    call = stub.Generate(plan.request, timeout=plan.timeout_s)
    messages: list[Any] = []
    try:
        for message in call:
            messages.append(message)
            if plan.cancel_after is not None and len(messages) > plan.cancel_after:
                call.cancel()
                break
    except grpc.RpcError as err:
        check_status(err, plan)
        return err.code().name
    check_stream(messages, plan)
    if plan.cancel_after is not None and len(messages) > plan.cancel_after:
        return "cancelled by the client"
    return "OK"


def check_stream(messages: list[Any], plan: Plan) -> None:
    samples = plan.request.n or 1
    finals = [i for i, m in enumerate(messages) if m.HasField("final")]
    ended = len(finals) == samples
    if plan.cancel_after is not None and len(messages) > plan.cancel_after and not ended:
        return  # the client left before the end
    assert ended and finals[-1] == len(messages) - 1, (
        f"a stream must end with one final per sample ({samples}): "
        f"{[m.WhichOneof('response') for m in messages]}"
    )
    assert sorted(messages[i].final.index for i in finals) == list(range(samples))
    for i in finals:
        assert messages[i].final.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    last = messages[-1].final
    assert last.HasField("total_usage") == (samples > 1)
    text = "".join(m.chunk.text for m in messages if m.HasField("chunk"))
    assert last.usage.completion_tokens >= 0 and isinstance(text, str)


def check_status(err: grpc.RpcError, plan: Plan) -> None:
    code = err.code()
    details = err.details() or ""
    assert code in CLIENT_CODES, f"{code.name}: {details} for {plan.request!r:.600}"
    assert details, f"{code.name} without a message"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
        assert status is not None, "INVALID_ARGUMENT without a google.rpc.Status"
        bad = error_details_pb2.BadRequest()
        assert any(d.Unpack(bad) for d in status.details), "no BadRequest detail"
        fields = [v.field for v in bad.field_violations]
        assert fields and all(fields), "a violation without a field"
        for f in fields:
            assert f in details, f"the message does not name {f}: {details}"
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        status = rpc_status.from_call(err)  # type: ignore[arg-type]
        assert status is not None, "FAILED_PRECONDITION without a google.rpc.Status"
        failure = error_details_pb2.PreconditionFailure()
        assert any(d.Unpack(failure) for d in status.details), "no PreconditionFailure"
        subjects = [v.subject for v in failure.violations]
        assert subjects and all(s in details for s in subjects), details
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert plan.timeout_s < 1, f"DEADLINE_EXCEEDED with a {plan.timeout_s} s deadline"
    if code == grpc.StatusCode.CANCELLED:
        assert plan.cancel_after is not None
