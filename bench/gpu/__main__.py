"""Switchyard's vLLM path on a GPU, side by side with vLLM's own fronts, in one session.

    python -m bench.gpu --phase fronts --out DIR     # AsyncLLM in-process, worker, control plane
    python -m bench.gpu --phase peers --out DIR      # vLLM's OpenAI and gRPC servers
    python -m bench.gpu --phase quant --out DIR      # quantization: fp8, kv_cache_dtype: fp8
    python -m bench.gpu --phase tp --out DIR         # tensor_parallel_size 1 and 2 (2 GPUs)
    python -m bench.gpu --report DIR...              # the GPU section of docs/benchmarks.md

Made for the lent H200 (scripts/gpu-bench.sh runs it there): an 8B Llama shape with random
weights (`load_format: dummy`), the guide's workload (128 prompt and 256 output tokens,
ignore_eos) at 100 and at 1000 concurrent requests. Every system gets the same engine
settings (SETTINGS, listed in the report). Load comes from several client processes, so
that no Python client is the limit. Each phase writes DIR/<phase>.json.
"""

from __future__ import annotations

import argparse
import asyncio
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
from bench.load.loadgen import Workload, make_target
from bench.load.procload import percentiles, spread_load
from switchyard_common.logs import configure_logging

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
TTFT_PAIRS = 60


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


# ---- load from several processes -------------------------------------------------------


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


# ---- the systems ----------------------------------------------------------------------


def asyncllm_inprocess(
    model: Path, settings: dict[str, Any], loads: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """vLLM's AsyncLLM in this process, DELTA streaming: the ceiling for any front."""
    argv = asyncllm_argv(model, settings, loads or LOADS)
    out = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=900, check=True)
    return [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]


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


def _asyncllm_main(
    model: str,
    settings: dict[str, Any],
    loads: tuple[int, ...],
    go: bool = False,
    reps: int = 2,
    waves: int = 1,
) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from pyworker.engine import (
        LoadStats,
        make_stat_logger_factory,
        prepare_environment,
        token_prompt_factory,
    )

    prepare_environment(settings)
    make_prompt = token_prompt_factory()
    # The worker's own stat logger and settings (its scheduler counts, nothing else), so
    # the two engines do the same work per step and report the same batch counts.
    load = LoadStats()
    llm = AsyncLLM.from_vllm_config(
        AsyncEngineArgs(model=model, **settings).create_engine_config(),
        stat_loggers=[make_stat_logger_factory(load)],
        disable_log_stats=True,
    )

    async def one(i: int, prompt: list[int], n: int, seed: int) -> tuple[float | None, int]:
        params = SamplingParams(
            max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA, detokenize=False
        )
        start = time.perf_counter()
        ttft = None
        tokens = 0
        async for out in llm.generate(make_prompt(prompt), params, request_id=f"r{seed}-{i}"):
            if ttft is None:
                ttft = (time.perf_counter() - start) * 1000
            tokens += len(out.outputs[0].token_ids)
        return ttft, tokens

    async def run(requests: int, seed: int, waves: int = 1) -> dict[str, Any]:
        """`requests` at a time, `waves` times as many in all (closed loop)."""
        items = workload(requests * waves, seed).items()
        slots = asyncio.Semaphore(requests)

        async def slot(i: int, p: list[int], n: int) -> tuple[float | None, int]:
            async with slots:
                return await one(i, p, n, seed)

        seen: list[tuple[int, int, float]] = []

        async def watch() -> None:  # the engine's batch, as the worker's StreamLoad sees it
            while True:
                await asyncio.sleep(0.25)
                snap = load.snapshot()
                seen.append((snap.running, snap.waiting, 0.0))

        watcher = asyncio.get_running_loop().create_task(watch())
        start = time.perf_counter()
        got = await asyncio.gather(*(slot(i, p, n) for i, (p, n) in enumerate(items)))
        took = time.perf_counter() - start
        watcher.cancel()
        tokens = sum(t for _, t in got)
        return {
            "engine": {"in-process": systems.batch_summary(seen)},
            "system": "asyncllm",
            "requests": requests * waves,
            "concurrency": requests,
            "tokens": tokens,
            "seconds": took,
            "tokens_per_s": tokens / took,
            "errors": sum(1 for _, t in got if t != OUTPUT),
            "ttft_ms": percentiles([t for t, _ in got if t is not None]),
        }

    async def main() -> None:
        await run(32, seed=99)  # warm-up
        if go:  # started beside another engine: run when told, so the two never overlap
            print("READY", flush=True)
            await asyncio.to_thread(sys.stdin.readline)
        for load in loads:
            for _ in range(reps):
                print("RESULT " + json.dumps(await run(load, seed=1, waves=waves)), flush=True)

    asyncio.run(main())
    llm.shutdown()


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


def ttft_pairs(cp: str, worker: str, model: str) -> dict[str, Any]:
    """Single requests, alternating between the worker and the control plane in front
    (bench.compare's probe: distinct prompts, so neither hits the other's prefix cache)."""
    from bench.cpu.compare import ttft_probe

    factories = [
        lambda: make_target("worker", worker, model),
        lambda: make_target("switchyard", cp, model),
    ]
    got = asyncio.run(ttft_probe(factories, TTFT_PAIRS, PROMPT))
    w, s = got["worker"], got["switchyard"]
    return {
        "pairs": int(w["samples"]),
        "worker_ms": w,
        "switchyard_ms": s,
        "overhead_ms": {k: s[k] - w[k] for k in ("p50", "p99")},
        "distinct_prompts": True,
    }


def switchyard_fronts(
    model: Path, out: Path, settings: dict[str, Any], label: str, full: bool
) -> dict[str, Any]:
    """`switchyard serve` starting its vLLM worker; the worker called directly and the
    control plane in front of it, alternately at each load."""
    result: dict[str, Any] = {"label": label, "settings": settings, "runs": []}
    log_dir = out / f"logs-{label}"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with systems.control_plane(served_model("m", model, settings), log_dir) as (cp, proc):
        result["start_s"] = time.monotonic() - started
        workers = list_workers(cp)
        result["workers_at_start"] = workers
        worker = workers[0]["address"]
        run_load("switchyard", cp, "m", 32, seed=99)  # warm-up
        for load in LOADS:
            # ABBA: neither goes first every time (later runs find more shapes compiled)
            pair = ["worker", "switchyard", "switchyard", "worker"] if full else ["switchyard"]
            for target in pair:
                address = worker if target == "worker" else cp
                if full and load == LOADS[0] and target == "switchyard":
                    with gpu_memory_sampler(out / f"gpu-memory-{label}.csv"):
                        run = run_load(target, address, "m", load, seed=1)
                        result["workers_under_load"] = list_workers(cp)
                else:
                    run = run_load(target, address, "m", load, seed=1)
                log.info(
                    "run",
                    label=label,
                    system=target,
                    requests=load,
                    tokens_per_s=round(run["tokens_per_s"]),
                    ttft_p50_ms=run["ttft_ms"].get("p50"),
                )
                result["runs"].append(run)
        if full:
            result["ttft_pairs"] = ttft_pairs(cp, worker, "m")
        result["log_tail"] = proc.log_tail(40)
    return result


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
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    phases = "fronts peers quant tp saturate fast fast2".split()
    p.add_argument("--phase", choices=phases)
    p.add_argument("--out", type=Path)
    p.add_argument("--model-dir", type=Path, help="default: an 8B shape made in /tmp/llama-8b")
    p.add_argument("--smoke", action="store_true", help="a CPU check of the code paths")
    p.add_argument("--report", nargs="*", type=Path, help="result folders to write docs from")
    p.add_argument("--asyncllm", help=argparse.SUPPRESS)
    p.add_argument("--loads", default="", help=argparse.SUPPRESS)
    p.add_argument("--waves", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--go", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=0, help=argparse.SUPPRESS)
    for flag in ("--target", "--address", "--model"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--requests", "--concurrency", "--seed"):
        p.add_argument(flag, type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.asyncllm:
        loads = tuple(int(x) for x in args.loads.split(","))
        settings = json.loads(args.asyncllm)
        _asyncllm_main(str(args.model_dir), settings, loads, args.go, args.reps or 2, args.waves)
        return
    if args.report is not None:
        from bench.gpu.report import write_report

        write_report(args.report)
        return
    configure_logging("console", "info")
    if args.smoke:
        smoke()
    args.out.mkdir(parents=True, exist_ok=True)
    fast = args.phase in ("fast", "fast2")
    if args.model_dir:
        model = args.model_dir
    elif fast:
        model = make_model(Path("/tmp/llama-1b"), "1b")
    else:
        model = make_model(Path("/tmp/llama-8b"))
    result: dict[str, Any] = {"phase": args.phase, "environment": environment(), "systems": []}
    path = args.out / f"{args.phase}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    steps: list[tuple[str, Any]]
    if fast:
        from bench.gpu.fast import FAST_SETTINGS
        from bench.gpu.fast import steps as fast_steps

        result["environment"]["settings"] = FAST_SETTINGS
        steps = list(fast_steps(args.phase, model, args.out))
    elif args.phase == "tp":  # two GPUs (the nvidia-h200-x2 kind)
        from bench.gpu.tp import steps as tp_steps

        steps = tp_steps(model, args.out)
    elif args.phase == "saturate":  # a worker held saturated: the canary behind its queue
        from bench.gpu.tp import saturate_steps

        steps = saturate_steps(model, args.out)
    elif args.phase == "fronts":
        steps = [
            (
                "asyncllm",
                lambda: {"label": "asyncllm", "runs": asyncllm_inprocess(model, SETTINGS)},
            ),
            ("switchyard", lambda: switchyard_fronts(model, args.out, SETTINGS, "bf16", True)),
        ]
    elif args.phase == "peers":
        steps = [
            ("openai", lambda: peer("openai", model, args.out, SETTINGS)),
            ("vllm-grpc", lambda: peer("vllm-grpc", model, args.out, SETTINGS)),
        ]
    else:
        fp8 = {**SETTINGS, "quantization": "fp8"}
        kv8 = {**SETTINGS, "kv_cache_dtype": "fp8"}
        steps = [
            ("fp8", lambda: switchyard_fronts(model, args.out, fp8, "fp8", False)),
            ("kv-fp8", lambda: switchyard_fronts(model, args.out, kv8, "kv-fp8", False)),
        ]
    for name, step in steps:
        log.info("system", name=name)
        try:
            result["systems"].append(step())
        except Exception as exc:  # one system's failure is a result too; go on
            log.exception("system failed", name=name)
            result["systems"].append({"label": name, "error": f"{type(exc).__name__}: {exc}"})
        save()
    log.info("phase done", phase=args.phase, path=str(path))


if __name__ == "__main__":
    main()
