"""`pip install .` builds one wheel: the control plane, the vLLM worker, and the gRPC stubs
that the build generates from proto/ (never kept in the source tree)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_carries_generated_stubs(tmp_path: Path) -> None:
    # A real `pip wheel .` in an isolated build environment; the C++ part is left out here
    # (the set-up's own install builds it, and the test below uses what it built).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            "-C",
            "cmake.define.SWITCHYARD_BUILD_CPP=OFF",
            "-C",
            f"build-dir={tmp_path}/build",
            str(ROOT),
        ],
        check=True,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    (wheel,) = tmp_path.glob("switchyard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "switchyard/v1/common_pb2.py",
        "switchyard/v1/generation_pb2.py",
        "switchyard/v1/generation_pb2_grpc.py",
        "switchyard/worker/v1/worker_pb2.py",
        "switchyard/worker/v1/worker_pb2_grpc.py",
        "control/api/generation.py",
        "switchyard_common/rpc_status.py",
        "pyworker/servicer.py",
        "switchyard/__init__.py",
        "switchyard/client/sync.py",  # the client library, beside the stubs it uses
    ):
        assert expected in names, f"{expected} missing from {wheel.name}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "switchyard = control.cli:main" in text


def test_no_generated_code_in_the_source_tree() -> None:
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout (an sdist, say): there is no tracked tree to inspect")
    assert not [p for p in tracked if p.endswith(("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"))]


def test_install_has_the_cpp_worker_and_module() -> None:
    worker = Path(sys.executable).parent / "switchyard-cpp-worker"
    assert worker.exists(), "pip install . did not install the C++ worker binary"
    out = subprocess.run([str(worker), "--help"], capture_output=True, text=True, check=False)
    assert out.returncode == 0 and "--engine sim|trtllm" in out.stdout
    import switchyard_runtime

    assert switchyard_runtime.SimExecutor.token_at(1, 2, 3, 100) >= 4


def test_install_has_the_native_front() -> None:
    """`pip install .` puts libswitchyard_front.so in the switchyard package, where
    `api.front: native` finds it without any setting, and it loads."""
    import ctypes

    from control.api.front_lib import LIB_ENV, find_library

    assert not os.environ.get(LIB_ENV), f"{LIB_ENV} would hide where the install put it"
    path = find_library()
    assert path.parent.name == "_native" and path.parent.parent.name == "switchyard"
    assert ctypes.CDLL(str(path)).sy_front_start
