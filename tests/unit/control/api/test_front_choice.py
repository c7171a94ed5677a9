"""`api.front: auto` (the default): the native front where the build has it; grpc.aio,
with a warning that says why, where it does not; an explicit choice is kept either way."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from control import server
from control.api import front_lib


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget a library an earlier test loaded, so the next call looks again."""
    monkeypatch.setattr(front_lib, "_lib", None)


@pytest.mark.usefixtures("fresh_library")
def test_auto_takes_the_native_front_where_the_build_has_it() -> None:
    assert front_lib.unavailable() is None, "this build has the native front"
    with capture_logs() as logs:
        assert server._native_front("auto") is True
    assert logs == []


@pytest.mark.usefixtures("fresh_library")
def test_auto_serves_with_grpc_aio_and_says_why_where_the_library_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "libswitchyard_front.so"
    monkeypatch.setenv(front_lib.LIB_ENV, str(missing))
    with capture_logs() as logs:
        assert server._native_front("auto") is False
    [warning] = logs
    assert warning["log_level"] == "warning"
    assert "native front is not available" in warning["event"]
    assert str(missing) in warning["reason"]


@pytest.mark.usefixtures("fresh_library")
def test_an_explicit_front_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(front_lib.LIB_ENV, str(tmp_path / "missing.so"))
    assert server._native_front("python") is False
    # native is kept even here: the start then fails, naming the library
    assert server._native_front("native") is True
