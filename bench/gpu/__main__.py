"""Switchyard's vLLM path on a GPU, side by side with vLLM's own fronts, in one session.

    python -m bench.gpu --phase fronts --out DIR     # AsyncLLM in-process, worker, control plane
    python -m bench.gpu --phase peers --out DIR      # vLLM's OpenAI and gRPC servers
    python -m bench.gpu --phase quant --out DIR      # quantization: fp8, kv_cache_dtype: fp8
    python -m bench.gpu --phase tp --out DIR         # tensor_parallel_size 1 and 2 (2 GPUs)
    python -m bench.gpu --phase native --out DIR     # the native front beside grpc.aio (1B)
    python -m bench.gpu --phase native2 --out DIR    # two workers behind the native front
    python -m bench.gpu --phase native3 --out DIR    # vLLM's gRPC server and SMG beside it
    python -m bench.gpu --report DIR...              # docs/results/gpu.md

Made for the lent H200 (scripts/gpu-bench.sh runs it there): an 8B Llama shape with random
weights (`load_format: dummy`), the guide's workload (128 prompt and 256 output tokens,
ignore_eos) at 100 and at 1000 concurrent requests. Every system gets the same engine
settings (SETTINGS, listed in the report). Load comes from several client processes, so
that no Python client is the limit. Each phase writes DIR/<phase>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import structlog

from bench.gpu import common
from switchyard_common.logs import configure_logging

log = structlog.get_logger(__name__)


def main() -> None:
    p = argparse.ArgumentParser("python -m bench.gpu", description=__doc__.splitlines()[0])
    phases = "fronts peers quant tp saturate fast fast2 native native2 native3".split()
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
        from bench.gpu.fronts import run_asyncllm

        run_asyncllm(str(args.model_dir), settings, loads, args.go, args.reps or 2, args.waves)
        return
    if args.report is not None:
        from bench.gpu.report import write_report

        write_report(args.report)
        return
    configure_logging("console", "info")
    if args.smoke:
        common.smoke()
    args.out.mkdir(parents=True, exist_ok=True)
    fast = args.phase in ("fast", "fast2", "native", "native2", "native3")
    if args.model_dir:
        model = args.model_dir
    elif fast:
        model = common.make_model(Path("/tmp/llama-1b"), "1b")
    else:
        model = common.make_model(Path("/tmp/llama-8b"))
    result: dict[str, Any] = {
        "phase": args.phase,
        "environment": common.environment(),
        "systems": [],
    }
    path = args.out / f"{args.phase}.json"

    def save() -> None:
        path.write_text(json.dumps(result, indent=1))

    steps: list[tuple[str, Any]]
    if args.phase in ("native", "native2", "native3"):  # the native front on the fast shape
        from bench.gpu.fast import FAST_SETTINGS
        from bench.gpu.native import steps as native_steps

        result["environment"]["settings"] = FAST_SETTINGS
        steps = native_steps(args.phase, model, args.out)
    elif fast:
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
    else:  # fronts, peers, quant: the 8B shape
        from bench.gpu.fronts import steps as fronts_steps

        steps = fronts_steps(args.phase, model, args.out)
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
