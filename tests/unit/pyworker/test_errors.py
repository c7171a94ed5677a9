"""Which engine errors are the client's fault: only vLLM's own client-error family. A
ValueError from deep inside the engine is an engine fault (INTERNAL, so the control plane
fails over), never INVALID_ARGUMENT."""

from __future__ import annotations

import pytest
from vllm import exceptions as vllm_errors

from pyworker.engine_errors import classify, client_field
from pyworker.errors import InvalidArgument, Overloaded


def chained(outer: BaseException, cause: BaseException) -> BaseException:
    outer.__cause__ = cause
    return outer


def test_a_bare_value_error_in_the_engine_is_an_engine_fault() -> None:
    assert classify(ValueError("shape mismatch in a kernel")) is None
    assert classify(chained(RuntimeError("step failed"), ValueError("bad shape"))) is None


def test_vllm_client_errors_blame_the_field_vllm_names() -> None:
    err = chained(
        RuntimeError("engine said no"),
        vllm_errors.VLLMValidationError("too many", parameter="logprobs", value=99),
    )
    assert classify(err) is InvalidArgument
    assert client_field(err) == "logprobs"


@pytest.mark.parametrize("name", ["QueueOverflowError", "MaxQueuedTokensError"])
def test_a_full_engine_is_resource_exhausted(name: str) -> None:
    err = getattr(vllm_errors, name)()
    assert classify(err) is Overloaded
    assert Overloaded("full").code.name == "RESOURCE_EXHAUSTED"
