"""bench.gpu.report writes the whole GPU page from phase results: here from the 8B run kept in
results/gpu/, its raw figures back out compressed, and no text spliced between markers."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu.report import PAGE, page, write_report
from bench.results import RAW, read_json


def test_the_page_is_written_whole_from_the_kept_8b_run(tmp_path: Path) -> None:
    phases = read_json(RAW / "gpu" / "8b.json.xz")
    folders = []
    for i, phase in enumerate(phases):  # one result folder per device call, as a run gives
        folder = tmp_path / f"{i}-{phase['folder']}"
        folder.mkdir()
        (folder / f"{phase['phase']}.json").write_text(json.dumps(phase))
        folders.append(folder)
    pages, raw = tmp_path / "pages", tmp_path / "raw" / "8b.json.xz"
    write_report(folders, pages, raw)
    text = (pages / PAGE).read_text()
    assert text.startswith("# GPU benchmarks")
    assert "at commit " in text and "<!--" not in text
    assert "### Throughput" in text and "### Ratios against the targets" in text
    assert f"`{raw}`" in text  # outside the repository: named as given
    assert [p["phase"] for p in read_json(raw)] == [p["phase"] for p in phases]


def test_the_page_names_its_commit_and_raw_file() -> None:
    text = page(read_json(RAW / "gpu" / "8b.json.xz"), "abc1234")
    assert "at commit abc1234" in text
    assert "`results/gpu/8b.json.xz`" in text
