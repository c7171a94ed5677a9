"""TensorRT-LLM engine directories, as trtllm-build and the older build scripts write them,
read and checked by the C++ worker before any executor exists.

`switchyard-cpp-worker --check-engine DIR` runs the same parse and checks as
`--engine trtllm` and prints what GetInfo would report, so this runs without a GPU or
TensorRT-LLM. A rejected directory exits non-zero with one line that names the field.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from control.fleet.local_workers import cpp_worker_binary


def trtllm_build_config(
    version: str = "1.0.0",
    tp: int = 1,
    pp: int = 1,
    dtype: str = "bfloat16",
    quant_algo: str | None = None,
    kv_cache_quant_algo: str | None = None,
    max_input_len: int = 2048,
    max_seq_len: int = 8192,
    max_batch_size: int = 64,
    max_num_tokens: int = 8192,
    tokens_per_block: int = 32,
    paged_context_fmha: bool = True,
    vocab_size: int = 128256,
) -> dict[str, Any]:
    """A config.json as trtllm-build (TensorRT-LLM 0.9 and later) writes it."""
    return {
        "version": version,
        "pretrained_config": {
            "architecture": "LlamaForCausalLM",
            "dtype": dtype,
            "vocab_size": vocab_size,
            "hidden_size": 4096,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 8192,
            "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1},
            "quantization": {
                "quant_algo": quant_algo,
                "kv_cache_quant_algo": kv_cache_quant_algo,
                "group_size": 128,
            },
        },
        "build_config": {
            "max_input_len": max_input_len,
            "max_seq_len": max_seq_len,
            "max_batch_size": max_batch_size,
            "max_beam_width": 1,
            "max_num_tokens": max_num_tokens,
            "opt_num_tokens": None,
            "plugin_config": {
                "gpt_attention_plugin": "auto",
                "paged_kv_cache": True,
                "tokens_per_block": tokens_per_block,
                "use_paged_context_fmha": paged_context_fmha,
                "remove_input_padding": True,
            },
        },
    }


def legacy_config(tp: int = 2, quant_mode: int = 0) -> dict[str, Any]:
    """A config.json of the TensorRT-LLM 0.x per-model build scripts (no `version`)."""
    return {
        "builder_config": {
            "name": "llama",
            "precision": "float16",
            "tensor_parallel": tp,
            "pipeline_parallel": 1,
            "vocab_size": 32000,
            "num_heads": 32,
            "hidden_size": 4096,
            "num_layers": 32,
            "max_batch_size": 8,
            "max_input_len": 1024,
            "max_output_len": 512,
            "max_num_tokens": None,
            "quant_mode": quant_mode,
            "int8": False,
        },
        "plugin_config": {
            "gpt_attention_plugin": "float16",
            "paged_kv_cache": True,
            "tokens_per_block": 64,
            "use_paged_context_fmha": False,
            "remove_input_padding": True,
        },
    }


def engine_dir(tmp: Path, config: dict[str, Any] | str, ranks: list[str] | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config, indent=4)
    (tmp / "config.json").write_text(text)
    if ranks is None and isinstance(config, dict):
        if "version" in config:
            world = config["pretrained_config"]["mapping"]["world_size"]
            ranks = [f"rank{r}.engine" for r in range(world)]
        else:
            b = config["builder_config"]
            ranks = [
                f"llama_float16_tp{b['tensor_parallel']}_rank{r}.engine"
                for r in range(b["tensor_parallel"])
            ]
    for name in ranks or []:
        (tmp / name).write_bytes(b"")  # the engines' contents are the executor's business
    return tmp


def check(
    path: Path, *flags: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    argv = [cpp_worker_binary(), "--check-engine", str(path), *flags]
    full_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    full_env.update(env or {})
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=30, env=full_env, check=False
    )


def accepted(path: Path, *flags: str, **kw: Any) -> dict[str, Any]:
    out = check(path, *flags, **kw)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def rejected(path: Path, *flags: str, **kw: Any) -> str:
    out = check(path, *flags, **kw)
    assert out.returncode != 0, f"accepted: {out.stdout}"
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # one clear line, no usage dump
    return lines[0]


MACHINE = ("--trtllm-version", "1.0", "--gpus-visible", "8", "--eos-id", "128001")


@pytest.mark.parametrize(
    ("version", "tp", "pp", "quant", "kv_quant", "kv_dtype"),
    [
        ("1.0.0", 1, 1, None, None, "bfloat16"),
        ("1.0.0", 2, 1, "FP8", "FP8", "fp8"),
        ("1.0.1", 4, 2, "W4A16_AWQ", "INT8", "int8"),
        ("1.0.0rc4", 1, 4, "W8A8_SQ_PER_CHANNEL", None, "bfloat16"),
        ("1.0.0", 8, 1, "W8A16", None, "bfloat16"),
    ],
)
def test_trtllm_build_engines_report_what_they_are(
    tmp_path: Path,
    version: str,
    tp: int,
    pp: int,
    quant: str | None,
    kv_quant: str | None,
    kv_dtype: str,
) -> None:
    d = engine_dir(
        tmp_path,
        trtllm_build_config(version, tp, pp, quant_algo=quant, kv_cache_quant_algo=kv_quant),
    )
    info = accepted(d, *MACHINE)
    assert info["layout"] == "build_config"
    assert (info["tensor_parallel_size"], info["pipeline_parallel_size"]) == (tp, pp)
    assert info["orchestrator"] == (tp * pp > 1)
    assert info["quantization"] == (quant or "")
    assert info["weight_dtype"] == "bfloat16"
    assert info["kv_cache_dtype"] == kv_dtype
    assert (info["max_context"], info["max_input_len"]) == (8192, 2048)
    assert (info["vocab_size"], info["kv_block_size"]) == (128256, 32)
    assert (info["max_batch_size"], info["max_num_tokens"]) == (64, 8192)
    assert info["eos_token_ids"] == [128001]
    assert info["enable_chunked_context"] is True
    assert info["notes"] == []


def test_shapes_other_than_the_old_defaults_are_reported(tmp_path: Path) -> None:
    """The limits come from the engine, not from the flags' old defaults (4096/32000/32)."""
    d = engine_dir(
        tmp_path,
        trtllm_build_config(
            dtype="float16",
            max_input_len=500,
            max_seq_len=1000,
            max_batch_size=3,
            tokens_per_block=128,
            vocab_size=50000,
            paged_context_fmha=False,
        ),
    )
    info = accepted(d, "--trtllm-version", "1.0", "--gpus-visible", "1", "--eos-id", "7")
    assert (info["max_context"], info["max_input_len"], info["vocab_size"]) == (1000, 500, 50000)
    assert (info["kv_block_size"], info["max_batch_size"]) == (128, 3)
    assert info["enable_chunked_context"] is False  # no paged context FMHA


def test_the_older_builder_config_layout_is_read(tmp_path: Path) -> None:
    d = engine_dir(tmp_path, legacy_config(tp=2, quant_mode=2 | 64))  # int8 weights, int8 KV
    info = accepted(d, "--gpus-visible", "2", "--eos-id", "2")  # runtime version unknown
    assert info["layout"] == "builder_config"
    assert (info["tensor_parallel_size"], info["max_context"], info["max_input_len"]) == (
        2,
        1536,
        1024,
    )
    assert (info["quantization"], info["kv_cache_dtype"]) == ("W8A16", "int8")
    assert info["kv_block_size"] == 64
    assert any("version check skipped" in n for n in info["notes"])
    # A TensorRT-LLM 1.x runtime cannot load it: the check says so, naming `version`.
    assert "version: missing: the engine has the older builder_config layout" in rejected(
        d, "--trtllm-version", "1.0", "--gpus-visible", "2", "--eos-id", "2"
    )


def test_eos_ids_from_tokenizer_or_engine(tmp_path: Path) -> None:
    d = engine_dir(tmp_path / "engine", trtllm_build_config())
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 128009}))
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008]}))
    base = ("--trtllm-version", "1.0", "--gpus-visible", "1")
    assert accepted(d, *base)["eos_token_ids"] == [128009]
    info = accepted(d, *base, "--tokenizer", str(tok))
    assert (info["eos_token_ids"], info["eos_source"]) == ([128001, 128008], "tokenizer")
    assert accepted(d, *base, "--tokenizer", str(tok), "--eos-id", "2,3")["eos_token_ids"] == [2, 3]
    (d / "generation_config.json").unlink()
    assert "--eos-id: no EOS id known" in rejected(d, *base)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (("--trtllm-version", "0.21"), "version: the engine was built by TensorRT-LLM 1.0.0"),
        (("--gpus-visible", "1"), "pretrained_config.mapping.world_size: the engine needs 2 GPUs"),
        (("--vocab-size", "130000"), "--vocab-size: the tokenizer has 130000 tokens"),
        (("--eos-id", "200000"), "--eos-id: EOS id 200000 is outside the engine's vocabulary"),
        (
            ("--max-context", "9000"),
            "--max-context: 9000 exceeds the engine's build_config.max_seq_len",
        ),
        (("--max-batch-size", "128"), "--max-batch-size: 128 is outside 1..64"),
        (("--tokens-per-block", "64"), "--tokens-per-block: 64 differs from the engine's"),
    ],
)
def test_contradictions_fail_naming_the_field(
    tmp_path: Path, flags: tuple[str, ...], field: str
) -> None:
    d = engine_dir(tmp_path, trtllm_build_config(tp=2))
    defaults = dict(zip(MACHINE[::2], MACHINE[1::2], strict=True))
    defaults.update(dict(zip(flags[::2], flags[1::2], strict=True)))
    argv = [x for kv in defaults.items() for x in kv]
    assert field in rejected(d, *argv)


def test_chunked_context_only_where_the_engine_allows_it(tmp_path: Path) -> None:
    d = engine_dir(tmp_path, trtllm_build_config(paged_context_fmha=False))
    assert "--enable-chunked-context: the engine was built without" in rejected(
        d, *MACHINE, "--enable-chunked-context", "1"
    )
    assert accepted(d, *MACHINE, "--enable-chunked-context", "0")["enable_chunked_context"] is False


def test_visible_gpus_from_cuda_visible_devices(tmp_path: Path) -> None:
    d = engine_dir(tmp_path, trtllm_build_config(tp=2))
    flags = ("--trtllm-version", "1.0", "--eos-id", "1")
    assert accepted(d, *flags, env={"CUDA_VISIBLE_DEVICES": "0,1"})["world_size"] == 2
    assert "2 GPUs (tp 2 x pp 1); 1 are visible" in rejected(
        d, *flags, env={"CUDA_VISIBLE_DEVICES": "3"}
    )
    assert "0 are visible" in rejected(d, *flags, env={"CUDA_VISIBLE_DEVICES": ""})
    # Unknown without CUDA_VISIBLE_DEVICES in a build without CUDA: skipped, and said so.
    assert any("world-size check skipped" in n for n in accepted(d, *flags)["notes"])


@pytest.mark.parametrize(
    ("config", "ranks", "field"),
    [
        ("{not json", ["rank0.engine"], "config.json: not valid JSON"),
        (json.dumps({"pretrained_config": {}}), ["rank0.engine"], "version: missing"),
        (None, ["rank0.engine"], "rank1.engine: missing"),
        ("DTYPE", None, "pretrained_config.dtype: 'int4' is not a dtype"),
        ("NO_SEQ_LEN", None, "build_config.max_seq_len: missing"),
        ("INPUT_TOO_LONG", None, "build_config.max_input_len: 9000 exceeds max_seq_len 8192"),
        ("NOT_PAGED", None, "build_config.plugin_config.paged_kv_cache: false"),
    ],
)
def test_broken_engine_directories_fail_naming_the_field(
    tmp_path: Path, config: str | None, ranks: list[str] | None, field: str
) -> None:
    c = trtllm_build_config(tp=2)
    text: dict[str, Any] | str
    if config == "DTYPE":
        c["pretrained_config"]["dtype"] = "int4"
    elif config == "NO_SEQ_LEN":
        del c["build_config"]["max_seq_len"]
    elif config == "INPUT_TOO_LONG":
        c["build_config"]["max_input_len"] = 9000
    elif config == "NOT_PAGED":
        c["build_config"]["plugin_config"]["paged_kv_cache"] = False
    text = c if config is None or config.isupper() else config
    d = engine_dir(tmp_path, text, ranks)
    assert field in rejected(d, *MACHINE)


def test_not_an_engine_directory(tmp_path: Path) -> None:
    assert "config.json: missing in" in rejected(tmp_path, *MACHINE)
    assert "is not a directory" in rejected(tmp_path / "nope", *MACHINE)


def test_trtllm_engine_in_a_build_without_tensorrt_llm_fails_clearly(tmp_path: Path) -> None:
    d = engine_dir(tmp_path, trtllm_build_config())
    out = subprocess.run(
        [cpp_worker_binary(), "--engine", "trtllm", "--model", str(d), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode != 0
    assert "built without TensorRT-LLM" in out.stderr
