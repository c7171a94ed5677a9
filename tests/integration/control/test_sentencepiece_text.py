"""The text a client sees on a real SentencePiece vocabulary (Mistral-7B-v0.1's, with
byte-fallback tokens and `▁` word marks), through the control plane, from both workers:
vLLM with random weights (`load_format: dummy`) on a two-layer model of that vocabulary,
and the C++ worker's simulator drawing from the same vocabulary.

Streamed text is exactly the text of decoding the whole output after the prompt, on
prompts with CJK, emoji, combining and control characters, and a stop string taken from
that text cuts the stream exactly where the text has it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from switchyard.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from tests.procs import Proc, serving_control
from tests.sentencepiece_model import PROMPTS, ensure_sentencepiece_model

FR = common_pb2.FinishReason
MODELS = ("sp-vllm", "sp-sim")


@pytest.fixture(scope="module")
def sp_dir() -> Path:
    return ensure_sentencepiece_model()


@pytest.fixture(scope="module")
def sp_control(sp_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    models = (
        f"  - name: sp-vllm\n    engine: vllm\n    model: {sp_dir}\n"
        "    engine_args: {load_format: dummy, max_model_len: 1024, max_num_seqs: 8}\n"
        f"  - name: sp-sim\n    engine: sim\n    model: {sp_dir}\n    tokenizer: {sp_dir}\n"
    )
    tmp = tmp_path_factory.mktemp("sp-control")
    with serving_control(tmp, models, *MODELS, name="sp-control", timeout=400) as proc:
        yield proc


@pytest.fixture(scope="module")
def hf(sp_dir: Path) -> object:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(sp_dir))


def generate(
    stub: generation_pb2_grpc.GenerationStub, model: str, prompt: str, seed: int, stop: str = ""
) -> tuple[list[generation_pb2.Chunk], generation_pb2.Final]:
    req = generation_pb2.GenerateRequest(model=model, text=prompt)
    req.sampling.temperature = 1.0
    req.sampling.seed = seed
    req.stopping.max_tokens = 160
    req.stopping.ignore_eos = True
    if stop:
        req.stopping.stop.append(stop)
    chunks, final = [], None
    for msg in stub.Generate(req, timeout=120):
        if msg.HasField("chunk"):
            chunks.append(msg.chunk)
        else:
            final = msg.final
    assert final is not None
    return chunks, final


def whole_text(hf: object, prompt_ids: list[int], ids: list[int]) -> str:
    decode = hf.decode  # type: ignore[attr-defined]
    return str(decode(prompt_ids + ids, skip_special_tokens=True))[
        len(decode(prompt_ids, skip_special_tokens=True)) :
    ]


@pytest.mark.parametrize("model", MODELS)
def test_streamed_text_is_the_whole_decode_and_stops_cut_exactly(
    sp_control: Proc, hf: object, model: str
) -> None:
    byte_tokens = 0
    with grpc.insecure_channel(sp_control.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        for seed, prompt in enumerate(PROMPTS * 2):
            prompt_ids = list(
                stub.Tokenize(generation_pb2.TokenizeRequest(model=model, text=prompt)).token_ids
            )
            chunks, final = generate(stub, model, prompt, seed)
            ids = [t for c in chunks for t in c.token_ids]
            assert len(ids) == final.usage.completion_tokens == 160
            text = "".join(c.text for c in chunks)
            assert text == whole_text(hf, prompt_ids, ids), (prompt, ids)
            byte_tokens += sum(3 <= t < 259 for t in ids)

            # A stop string from the middle of that text, where it first occurs.
            start = len(text) // 2
            while "\ufffd" in text[start : start + 3] or not text[start : start + 3].strip():
                start += 1
            stop = text[start : start + 3]
            at = text.index(stop)
            cut, stopped = generate(stub, model, prompt, seed, stop)
            assert "".join(c.text for c in cut) == text[:at], (prompt, stop)
            assert stopped.finish_reason == FR.FINISH_REASON_STOP
            assert stopped.stop_string == stop
            cut_ids = [t for c in cut for t in c.token_ids]
            assert cut_ids == ids[: len(cut_ids)]
            assert stop in whole_text(hf, prompt_ids, cut_ids)
    # Random outputs over 32,000 pieces (1,280 tokens, a different seed each time,
    # about 10 of them expected): some of them byte-fallback tokens.
    assert byte_tokens > 0
