"""The embedded default model: a tiny Llama with random weights, made here, never downloaded.

`ensure_tiny_model()` writes it once into the cache directory and returns its path:
a byte-level BPE tokenizer trained on the few lines below, and a two-layer Llama with
head_dim 64 (the CPU attention kernel rejects smaller heads). The weights are seeded, so
every machine makes the same model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

TINY_MODEL_NAME = "tiny"
# Bump when the recipe changes, so a stale cache is not reused.
_RECIPE_VERSION = "2"  # 2: a chat template

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
# A plain chat template (the tiny vocabulary has no turn markers): "role: content" lines,
# then "assistant:" when a reply is wanted.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_CORPUS = [
    "Switchyard routes every request to the worker that can serve it best.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Hello, world! Hello again, and welcome to the tiny model.",
    "Tokens stream back one by one until the model stops or the limit is reached.",
    "Il était une fois un petit modèle qui parlait français et deutsch: grüße, straße.",
    "日本語のテキストも少しだけ含まれています。こんにちは世界。",
    "Emoji travel in several bytes: 🚂 🚃 🚄 ✨ and numbers 0123456789.",
    "def generate(prompt: str) -> str: return prompt + ' done'",
]

TINY_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "vocab_target": 512,
}


def default_cache_dir() -> Path:
    env = os.environ.get("SWITCHYARD_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "switchyard"


def tiny_model_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / f"tiny-llama-v{_RECIPE_VERSION}"


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """Return the tiny model's directory, generating it first if it is not there."""
    target = tiny_model_path(cache_dir)
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log.info("generating tiny model", path=str(target), step="1/3 tokenizer")
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        vocab_size, bos_id, eos_id = _write_tokenizer(tmp)
        log.info("generating tiny model", step="2/3 weights", vocab_size=vocab_size)
        _write_model(tmp, vocab_size, bos_id, eos_id)
        log.info("generating tiny model", step="3/3 publish")
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished first; its copy is identical.
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("tiny model ready", path=str(target), seconds=round(time.monotonic() - started, 1))
    return target


def _write_tokenizer(out: Path) -> tuple[int, int, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(TINY_CONFIG["vocab_target"]),
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    eos_id = tok.token_to_id(EOS)
    assert bos_id is not None and eos_id is not None
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "add_bos_token": True,
                "model_max_length": TINY_CONFIG["max_position_embeddings"],
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return tok.get_vocab_size(), bos_id, eos_id


def _write_model(out: Path, vocab_size: int, bos_id: int, eos_id: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=TINY_CONFIG["hidden_size"],
        intermediate_size=TINY_CONFIG["intermediate_size"],
        num_hidden_layers=TINY_CONFIG["num_hidden_layers"],
        num_attention_heads=TINY_CONFIG["num_attention_heads"],
        num_key_value_heads=TINY_CONFIG["num_key_value_heads"],
        head_dim=TINY_CONFIG["head_dim"],
        max_position_embeddings=TINY_CONFIG["max_position_embeddings"],
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    # A wider spread than the default init gives peaked, varied output distributions,
    # so greedy decoding does not collapse onto one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id})
    )
