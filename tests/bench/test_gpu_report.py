"""The GPU section of docs/benchmarks.md survives the CPU benchmark rewriting the rest."""

from __future__ import annotations

from bench.gpu.report import BEGIN, END, kept_section, splice


def test_the_gpu_section_is_replaced_in_place_and_kept() -> None:
    doc = "# Benchmarks\n\nCPU tables\n"
    first = splice(doc, f"{BEGIN}\nH200 v1\n{END}")
    assert first.startswith("# Benchmarks") and "H200 v1" in first
    second = splice(first + "\ntail\n", f"{BEGIN}\nH200 v2\n{END}")
    assert "H200 v1" not in second and "H200 v2" in second and second.endswith("tail\n")
    assert kept_section(second) == f"{BEGIN}\nH200 v2\n{END}"
    assert kept_section(doc) == ""


def test_the_fast_engine_section_is_kept_too() -> None:
    from bench.gpu.report import FAST_BEGIN, FAST_END

    doc = f"# Benchmarks\n\nCPU\n\n{BEGIN}\nH200\n{END}\n\n{FAST_BEGIN}\n1B\n{FAST_END}\n"
    assert kept_section(doc) == f"{BEGIN}\nH200\n{END}\n\n{FAST_BEGIN}\n1B\n{FAST_END}"
    assert "1B" in splice(doc, f"{BEGIN}\nH200 v2\n{END}")


def test_the_tensor_parallel_section_is_kept_too() -> None:
    from bench.gpu.report import FAST_BEGIN, FAST_END, TP_BEGIN, TP_END

    doc = f"CPU\n\n{FAST_BEGIN}\n1B\n{FAST_END}\n\n{TP_BEGIN}\nTP=2\n{TP_END}\n"
    assert kept_section(doc) == f"{FAST_BEGIN}\n1B\n{FAST_END}\n\n{TP_BEGIN}\nTP=2\n{TP_END}"
