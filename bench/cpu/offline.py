"""The engine alone, offline: vllm.LLM.generate on the benchmark's prompts (the ceiling).

Run as a separate process (vLLM spawns its engine): prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

RESULT_PREFIX = "BENCH_RESULT "  # vLLM logs to stdout too


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--prompt-len", type=int, nargs=2, required=True)
    p.add_argument("--output-len", type=int, nargs=2, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams, TokensPrompt

    from bench.load.loadgen import Workload

    work = Workload(
        requests=args.requests,
        prompt_len=tuple(args.prompt_len),
        output_len=tuple(args.output_len),
        seed=args.seed,
    ).items()
    llm = LLM(model=args.model, max_model_len=2048, max_num_batched_tokens=16384, dtype="float32")
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in work]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False) for _, n in work]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"output_tokens": tokens, "seconds": took, "tokens_per_s": tokens / took}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
