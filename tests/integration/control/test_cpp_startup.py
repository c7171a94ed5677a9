"""A C++ worker that cannot start says why, and `switchyard serve` repeats it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from control.fleet.local_workers import cpp_worker_binary, free_port
from tests.procs import serve_startup_failure


def test_a_cpp_worker_that_cannot_start_names_the_reason(tmp_path: Path) -> None:
    term = tmp_path / "why"
    out = subprocess.run(
        [
            cpp_worker_binary(), "--engine", "sim", "--sim-eos-convention", "hf",
            "--port", str(free_port()), "--termination-log", str(term),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    said = term.read_text().strip()
    assert said == "--sim-eos-convention: expected vllm or trtllm, got hf"
    assert said in out.stderr


def test_serve_repeats_what_the_cpp_worker_said(tmp_path: Path, tiny_model_dir: Path) -> None:
    # A TensorRT-LLM engine directory the worker must refuse: built for 2 GPUs (and, in a
    # build without TensorRT-LLM, --engine trtllm itself is refused).
    engine = tmp_path / "engine"
    engine.mkdir()
    (engine / "config.json").write_text(
        json.dumps(
            {
                "version": "0.20.0",
                "pretrained_config": {
                    "architecture": "LlamaForCausalLM",
                    "dtype": "bfloat16",
                    "vocab_size": 512,
                    "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1},
                },
                "build_config": {"max_input_len": 1024, "max_seq_len": 2048},
            }
        )
    )
    cfg = tmp_path / "switchyard.yaml"
    cfg.write_text(
        f"listen: 127.0.0.1:{free_port()}\n"
        "models:\n"
        "  - name: t\n"
        "    engine: trtllm\n"
        f"    model: {engine}\n"
        f"    tokenizer: {tiny_model_dir}\n"
    )
    failed = serve_startup_failure(cfg, timeout=120)
    # The worker's own reason, not "exited with code 2 (its log is above)".
    assert "model t:" in failed and "exited with code" not in failed, failed
    assert "world_size" in failed or "built without TensorRT-LLM" in failed, failed
