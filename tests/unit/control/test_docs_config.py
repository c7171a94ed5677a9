"""Every configuration example in the docs loads through the real parser, so a page cannot
drift from what `switchyard serve` accepts. Paths an example names (`/models/...`,
`/etc/...`) are made under a temporary directory first; a block that is part of a model
entry is read inside one; a block with no models gets one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from control.api.auth import TokenStore
from control.config import load_config

ROOT = Path(__file__).resolve().parents[3]
PAGES = ("README.md", "docs/configuration.md", "docs/operations.md")
# Top-level keys of a file that is not the service's configuration (Prometheus's own).
NOT_OURS = {"scrape_configs"}
PATH = re.compile(r"(?<![\w.:])/(?:models|engines|path|etc)/[\w./-]+")
FILE_SUFFIXES = {".pem", ".key", ".yaml", ".jinja"}
A_MODEL = "models:\n  - name: doc-example\n    engine: sim\n    model: builtin:tiny\n"


def yaml_blocks() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        text = (ROOT / page).read_text()
        for i, block in enumerate(re.findall(r"```yaml\n(.*?)```", text, re.S)):
            found.append((page, i, block))
    return found


def with_paths_made(block: str, root: Path) -> str:
    """The block with each absolute example path moved under `root`, where it exists:
    a file where the name ends as one does (a PEM, a tokens file), else a directory."""

    def made(match: re.Match[str]) -> str:
        path = root / match.group(0).lstrip("/")
        if path.suffix in FILE_SUFFIXES:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        else:
            path.mkdir(parents=True, exist_ok=True)
        return str(path)

    return PATH.sub(made, block)


BLOCKS = yaml_blocks()


def test_the_pages_have_examples() -> None:
    assert len(BLOCKS) >= 8, [(p, i) for p, i, _ in BLOCKS]


@pytest.mark.parametrize(("page", "index"), [(p, i) for p, i, _ in BLOCKS])
def test_a_yaml_example_loads(page: str, index: int, tmp_path: Path) -> None:
    block = next(b for p, i, b in BLOCKS if (p, i) == (page, index))
    block = with_paths_made(block, tmp_path)
    if block.startswith(" "):  # a part of one model's entry
        block = A_MODEL + block
    parsed = yaml.safe_load(block)
    if set(parsed) <= NOT_OURS:
        pytest.skip(f"{page} block {index} is Prometheus's configuration, not ours")
    if "tokens" in parsed:  # the tokens file, read by its own parser
        tokens = tmp_path / "tokens.yaml"
        tokens.write_text(block.replace("<sha256 hex of the secret>", "ab" * 32))
        assert len(TokenStore(tokens)._callers) == len(parsed["tokens"])
        return
    if "models" not in parsed:
        block += A_MODEL
    config = tmp_path / "switchyard.yaml"
    config.write_text(block)
    loaded = load_config(config)
    assert loaded.models
