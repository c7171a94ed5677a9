"""What the GPU phases share: the engine settings and workload, the generated model, load
from several client processes, the command of an AsyncLLM process, a `switchyard serve`
model entry, ListWorkers, nvidia-smi's memory samples, one run of a vLLM server, and the
environment a result records.

`smoke()` (`bench.gpu --smoke`) swaps in the settings of a CPU check of the code paths;
the phases read them from this module at run time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

from bench import systems
from bench.load.loadgen import Workload
from bench.load.procload import spread_load
from bench.results import commit

log = structlog.get_logger(__name__)

SETTINGS: dict[str, Any] = {
    "load_format": "dummy",
    "dtype": "bfloat16",
    "gpu_memory_utilization": 0.85,
    "max_model_len": 4096,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "seed": 0,
}
LOADS = (100, 1000)  # concurrent requests; each run sends that many
PROMPT, OUTPUT = 128, 256
CLIENT_PROCS = 4
CONNECTIONS = 8  # channels per client process
TTFT_PAIRS = 100


def make_model(path: Path, shape: str = "8b") -> Path:
    """A Llama-3.1-8B-shaped (or, with shape "1b", Llama-3.2-1B-shaped) config.json (vLLM's
    load_format dummy makes random weights) and a word-level tokenizer of the same
    vocabulary (id N is the word tN), so that every server can detokenize and every id
    round-trips. Seconds, no downloads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab, bos, eos = 128256, 128000, 128001
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": vocab,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": bos,
        "eos_token_id": eos, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip
    if shape == "1b":
        config.update(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
            tie_word_embeddings=True,
        )  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    words = {f"t{i}": i for i in range(vocab) if i not in (bos, eos)}
    words.update({"<|begin_of_text|>": bos, "<|end_of_text|>": eos})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "model_max_length": 8192,
    }))  # fmt: skip
    return path


def smoke() -> None:
    """--smoke: every code path of the benchmark on a CPU, in minutes (the tiny model)."""
    global LOADS, OUTPUT, PROMPT, TTFT_PAIRS, CLIENT_PROCS, SETTINGS
    os.environ[SMOKE_ENV] = "1"  # for the client processes this starts
    LOADS, OUTPUT, PROMPT, TTFT_PAIRS, CLIENT_PROCS = (4, 8), 8, 16, 3, 2
    SETTINGS = {"max_model_len": 2048, "max_num_seqs": 16, "dtype": "float32", "seed": 0}


SMOKE_ENV = "SWITCHYARD_BENCH_GPU_SMOKE"
if os.environ.get(SMOKE_ENV):
    smoke()


def workload(requests: int, seed: int = 0) -> Workload:
    return Workload(
        requests=requests,
        prompt_len=(PROMPT, PROMPT),
        output_len=(OUTPUT, OUTPUT),
        vocab=(4, 500) if PROMPT < 128 else (1000, 120000),
        seed=seed,
    )


def run_load(
    target: str,
    address: str,
    model: str,
    requests: int,
    seed: int = 0,
    processes: int = 0,
    waves: int = 1,
) -> dict[str, Any]:
    """`requests` concurrent requests (all at once, closed loop; `waves` times as many in
    all, each finished one replaced by the next) from several processes (CLIENT_PROCS, or
    `processes`), each over CONNECTIONS channels so that router processes sharing a port
    all get traffic."""
    return spread_load(
        target,
        address,
        model,
        workload(requests * waves, seed),
        requests,
        processes=processes or CLIENT_PROCS,
        connections=CONNECTIONS,
    )


def asyncllm_argv(
    model: Path, settings: dict[str, Any], loads: tuple[int, ...], waves: int = 1
) -> list[str]:
    """The command of a process that runs AsyncLLM at `loads` (concurrent requests,
    `waves` times as many in all) and prints RESULT lines."""
    return [
        sys.executable, "-m", "bench.gpu", "--asyncllm", json.dumps(settings),
        "--model-dir", str(model), "--loads", ",".join(map(str, loads)),
        "--waves", str(waves),
    ]  # fmt: skip


def served_model(
    name: str, model: Path, settings: dict[str, Any], gpus: tuple[str, ...] = ()
) -> str:
    """A model entry of `switchyard serve` that starts its own vLLM worker (on `gpus`)."""
    return (
        f"  - name: {name}\n    engine: vllm\n    model: {model}\n"
        f"    engine_args: {json.dumps(settings)}\n"
        "    limits: {max_concurrency: 1024, max_queue: 1024}\n"
        + (f"    gpus: {json.dumps(list(gpus))}\n" if gpus else "")
    )


def list_workers(address: str) -> list[dict[str, Any]]:
    import grpc
    from google.protobuf import json_format
    from switchyard.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        r = admin_pb2_grpc.AdminStub(ch).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
    return [json_format.MessageToDict(w, preserving_proto_field_name=True) for w in r.workers]


@contextlib.contextmanager
def gpu_memory_sampler(
    path: Path, interval_ms: int = 500, query: str = "timestamp,memory.used,memory.total"
) -> Iterator[None]:
    """nvidia-smi's reading of the GPUs' memory in use (`query`'s fields, one line per GPU),
    every interval, into a CSV."""
    if shutil.which("nvidia-smi") is None:
        yield  # no GPU here (--smoke)
        return
    with open(path, "w") as f:
        proc = subprocess.Popen(
            [
                "nvidia-smi", f"--query-gpu={query}",
                "--format=csv,noheader,nounits", f"-lms={interval_ms}",
            ],
            stdout=f,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def peer(
    kind: str,
    model: Path,
    out: Path,
    settings: dict[str, Any],
    loads: tuple[int, ...] = (),
    processes: int = 0,
    label: str = "",
    waves: int = 1,
) -> dict[str, Any]:
    """vLLM's OpenAI or gRPC server with `settings`, one run at each of `loads`."""
    label = label or kind
    log_dir = out / f"logs-{label}"
    log_dir.mkdir(parents=True, exist_ok=True)
    start = systems.vllm_openai_server if kind == "openai" else systems.vllm_grpc_server
    target = "openai" if kind == "openai" else "vllm-grpc"
    result: dict[str, Any] = {"label": label, "runs": []}
    started = time.monotonic()
    with start(model, log_dir, settings) as running:
        result["start_s"] = time.monotonic() - started
        run_load(target, running.address, str(model), 32, 99)
        for load in loads or LOADS:
            run = run_load(target, running.address, str(model), load, 1, processes, waves)
            run["label"] = kind
            log.info("run", label=label, requests=load, tokens_per_s=round(run["tokens_per_s"]))
            result["runs"].append(run)
    return result


def environment() -> dict[str, Any]:
    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError as exc:
            return str(exc)

    import torch
    import vllm

    return {
        "gpu": sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"]),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "settings": SETTINGS,
        "workload": {"prompt": PROMPT, "output": OUTPUT, "loads": LOADS, "ignore_eos": True},
        "client_processes": CLIENT_PROCS,
        "commit": commit(),
    }
