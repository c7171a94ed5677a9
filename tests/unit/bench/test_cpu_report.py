"""bench.cpu.report writes the whole CPU page, with its plots, from the run kept in
results/cpu/: the figures, the command, the commit and where the raw figures are."""

from __future__ import annotations

from pathlib import Path

from bench.cpu import report
from bench.results import RAW, read_json


def test_the_page_is_written_whole_from_the_kept_run(tmp_path: Path) -> None:
    data = read_json(RAW / "cpu" / "benchmarks.json.xz")
    report.write({**data, "commit": "abc1234"}, tmp_path, "results/cpu/benchmarks.json.xz")
    text = (tmp_path / report.PAGE).read_text()
    assert text.startswith("# CPU benchmarks")
    assert f"Produced by `{data['command']}` at commit abc1234" in text
    assert "## Throughput" in text and "## Targets in this run" in text
    assert "Raw numbers: `results/cpu/benchmarks.json.xz`" in text
    assert "<!--" not in text  # nothing kept from another page
    assert (tmp_path / report.THROUGHPUT_PNG).stat().st_size > 0
    assert (tmp_path / report.TTFT_PNG).stat().st_size > 0
