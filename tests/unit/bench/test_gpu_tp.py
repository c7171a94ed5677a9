"""The two-GPU phase's readings: nvidia-smi's per-GPU samples, and the comparison it
prints, also where one size did not start (as TP=2 does on a machine of one GPU)."""

from __future__ import annotations

from bench.gpu.tp import failure, gpu_memory, summary


def test_gpu_memory_keeps_each_gpus_peak() -> None:
    csv = (
        "2026/12/02 20:23:19.875, 0, 122601, 143771\n"
        "2026/12/02 20:23:19.875, 1, 3, 143771\n"
        "2026/12/02 20:23:20.375, 0, 123275, 143771\n"
        "2026/12/02 20:23:20.375, 1, [N/A], 143771\n"
        "garbage\n"
    )
    assert gpu_memory(csv) == {
        "0": {"peak_used_mib": 123275.0, "total_mib": 143771.0, "samples": 2},
        "1": {"peak_used_mib": 3.0, "total_mib": 143771.0, "samples": 1},
    }


def run(load: int, tokens_per_s: float, p50: float, p99: float) -> dict[str, object]:
    return {
        "concurrency": load, "tokens_per_s": tokens_per_s, "complete": True,
        "ttft_ms": {"p50": p50, "p99": p99},
    }  # fmt: skip


def test_the_summary_sets_tp2_against_tp1_and_names_a_size_that_did_not_start() -> None:
    tp1 = {
        "label": "tp1", "tensor_parallel_size": 1, "gpus": ["0"], "start_s": 114.0,
        "runs": [run(100, 12000, 300, 330), run(100, 12400, 320, 340), run(100, 12800, 340, 350)],
        "gpu_memory": {"100": {"0": {"peak_used_mib": 123275.0, "total_mib": 143771.0}}},
        "list_workers": [{"tensor_parallel_size": 1, "gpus": ["0"]}],
        "get_info": {"tensor_parallel_size": 1},
    }  # fmt: skip
    tp2 = {
        **tp1, "label": "tp2", "tensor_parallel_size": 2, "gpus": ["0", "1"],
        "runs": [run(100, 18600, 160, 200)],
        "list_workers": [{"tensor_parallel_size": 2, "gpus": ["0", "1"]}],
        "get_info": {"tensor_parallel_size": 2},
    }  # fmt: skip
    text = summary({"systems": [tp1, tp2]})
    assert (
        "| TP=1 | 0 | 100 | 3 of 3 runs | 12,400 | 320 | 340 | GPU 0: 123,275 of 143,771 |" in text
    )
    assert "- 100 requests, TP=2 / TP=1: output tok/s 1.50, TTFT p50 0.50, TTFT p99 0.59" in text
    assert (
        "tp2: GetInfo tensor_parallel_size 2, ListWorkers tensor_parallel_size 2 on GPUs 0,1"
        in text
    )
    error = (
        "RuntimeError: control exited with 1:\n[transformers] a warning\n"
        "2026-12-02T20:25:18Z [error    ] startup failed                 \n"
        "error='model m: engine_args.tensor_parallel_size / \nengine_args.pipeline_parallel_size:"
        " tensor_parallel_size x \npipeline_parallel_size = 2 GPUs, but 1 are visible'\n"
    )
    text = summary({"systems": [tp1, {"label": "tp2", "error": error}]})
    assert (
        "- tp2: did not serve: model m: engine_args.tensor_parallel_size / "
        "engine_args.pipeline_parallel_size: tensor_parallel_size x pipeline_parallel_size = "
        "2 GPUs, but 1 are visible"
    ) in text
    assert "TP=2 / TP=1" not in text
    assert failure("Traceback\nKeyError: 'x'") == "KeyError: 'x'"
