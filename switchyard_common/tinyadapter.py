"""A LoRA adapter for the tiny model, made here with `peft` (random weights, no
downloads), for trying adapters out and for the tests:

    python -m switchyard_common.tinyadapter OUT_DIR [--seed N] [--rank R]

`peft` is not a dependency of the service: `pip install peft` first.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import structlog

from switchyard_common.logs import configure_logging
from switchyard_common.tinymodel import ensure_tiny_model

log = structlog.get_logger(__name__)

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_tiny_adapter(
    out: Path, seed: int = 1, rank: int = 8, model_dir: Path | None = None
) -> Path:
    """A PEFT LoRA adapter (adapter_config.json and weights) for the tiny model in `out`.
    Its A and B are random (peft's default B is zero, which would change nothing), so the
    adapter changes what the model says, differently for each seed."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = model_dir or ensure_tiny_model()
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES), init_lora_weights=False
    )
    get_peft_model(base, config).save_pretrained(str(out))
    log.info("adapter written", path=str(out), rank=rank, seed=seed)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args()
    configure_logging("console", "info")
    make_tiny_adapter(args.out, args.seed, args.rank)


if __name__ == "__main__":
    main()
