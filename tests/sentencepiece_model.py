"""A tiny model on a real SentencePiece vocabulary, for the detokenization tests.

Mistral-7B-v0.1's tokenizer (`tokenizer.model.v1`, 32,000 pieces with byte fallback and
`▁` word marks) ships inside the `mistral-common` wheel, which vLLM depends on; it is
converted here to a fast tokenizer with `transformers`, and written beside a two-layer
Llama `config.json` of that vocabulary. There are no weights: vLLM runs it with
`load_format: dummy` (random weights, so its outputs range over the whole vocabulary,
byte tokens included), and the simulator draws its tokens from the same vocabulary.
Nothing is downloaded; the directory is made once per cache, like the tiny model.
"""

from __future__ import annotations

import importlib.resources
import json
import shutil
import tempfile
from pathlib import Path

from switchyard_common.tinymodel import TINY_CONFIG, default_cache_dir

BOS_ID, EOS_ID = 1, 2
_NAME = "tiny-sentencepiece-v1"

# Prompts with what streaming text gets wrong first: characters of several bytes (CJK,
# emoji and their joiners, flags), combining marks, control characters.
PROMPTS = [
    "Hello 日本語のテキスト 🚂",
    "combining: e\u0301 a\u0308 n\u0303 \u0915\u094d\u0937",
    "control \x07 bell \x1b[0m escape\ttab\r\nnewline",
    "👩\u200d👩\u200d👧 family, flags 🇫🇷, skin 👍🏽",
]


def ensure_sentencepiece_model(cache_dir: Path | None = None) -> Path:
    target = (cache_dir or default_cache_dir()) / "models" / _NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".sp-", dir=target.parent))
    try:
        _write(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; its copy is the same
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(out: Path) -> None:
    from transformers import AutoTokenizer

    source = importlib.resources.files("mistral_common") / "data" / "tokenizer.model.v1"
    slow = out / "slow"
    slow.mkdir()
    (slow / "tokenizer.model").write_bytes(source.read_bytes())
    (slow / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "legacy": False,
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(str(slow))
    assert tokenizer.is_fast and len(tokenizer) == 32000
    tokenizer.save_pretrained(str(out))
    shutil.rmtree(slow)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **{k: v for k, v in TINY_CONFIG.items() if k != "vocab_target"},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    )
