"""Chat prompts: a list of messages rendered with the model's chat template in the
control plane (the tiny model's tokenizer ships one), or the template the model's config
gives; a model without one answers FAILED_PRECONDITION."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from switchyard.v1 import generation_pb2, generation_pb2_grpc
from transformers import AutoTokenizer

from switchyard.client import Client, FailedPrecondition, InvalidArgument
from tests.procs import Proc, serving_control

CONVERSATION = [
    {"role": "system", "content": "You are a switchyard."},
    {"role": "user", "content": "Which track?"},
]


def test_messages_are_rendered_with_the_tokenizers_template(
    control: Proc, tiny_model_dir: Path
) -> None:
    # What the control plane must send the engine: the template's text, generation prompt
    # added, tokenized without adding special tokens again.
    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert text.endswith("assistant:") and "user: Which track?" in text
    with Client(control.address, timeout=60) as client:
        ids = client.tokenize("tiny", text, add_special_tokens=False).token_ids
        chat = client.complete("tiny", CONVERSATION, max_tokens=8, ignore_eos=True, temperature=0)
        plain = client.complete("tiny", ids, max_tokens=8, ignore_eos=True, temperature=0)
        streamed = list(client.generate("tiny", CONVERSATION, max_tokens=8, ignore_eos=True,
                                        temperature=0))  # fmt: skip
    assert chat.final.usage.prompt_tokens == len(ids)
    assert chat.token_ids == plain.token_ids  # the same prompt, greedy: the same answer
    assert tuple(t for c in streamed for t in c.token_ids) == chat.token_ids


def test_bad_messages_name_the_field(control: Proc) -> None:
    with grpc.insecure_channel(control.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        empty = generation_pb2.GenerateRequest(model="tiny", messages=generation_pb2.ChatMessages())
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(empty, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages.messages" in (e.value.details() or "")
    with Client(control.address, timeout=30) as client, pytest.raises(InvalidArgument) as bad:
        client.complete("tiny", [{"role": "", "content": "hi"}], max_tokens=2)
    assert [v.field for v in bad.value.violations] == ["messages.messages[0].role"]


@pytest.fixture(scope="module")
def sims(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """Simulator models: one whose tokenizer has no template, one whose config gives a
    template, one whose template refuses a conversation."""
    tmp = tmp_path_factory.mktemp("chat")
    bare = tmp / "bare-tokenizer"
    bare.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(tiny_model_dir / name, bare / name)
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp / "strict.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system messages here') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    sim = "    engine: sim\n    model: sim-label\n    engine_args: {decode_step_us: 500}\n"
    models = (
        f"  - name: no-template\n{sim}    tokenizer: {bare}\n"
        f"  - name: own-template\n{sim}    tokenizer: {bare}\n"
        "    chat_template: \"{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} "
        '{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"\n'
        f"  - name: strict\n{sim}    tokenizer: {bare}\n    chat_template: {tmp / 'strict.jinja'}\n"
    )
    names = ("no-template", "own-template", "strict")
    with serving_control(tmp, models, *names, timeout=120) as proc:
        yield proc


def test_a_model_without_a_template_is_a_failed_precondition(sims: Proc) -> None:
    with Client(sims.address, timeout=30) as client:
        with pytest.raises(FailedPrecondition) as e:
            client.complete("no-template", CONVERSATION, max_tokens=2)
        assert "no chat template" in e.value.message and "'no-template'" in e.value.message
        # Text prompts still work there.
        assert client.complete("no-template", "Hi", max_tokens=2, ignore_eos=True).final


def test_the_configs_template_is_used_and_can_refuse(sims: Proc) -> None:
    with Client(sims.address, timeout=30) as client:
        out = client.complete("own-template", CONVERSATION, max_tokens=2, ignore_eos=True)
        rendered = "[system] You are a switchyard. [user] Which track? [assistant]"
        expected = client.tokenize("own-template", rendered, add_special_tokens=False)
        assert out.final.usage.prompt_tokens == len(expected.token_ids)
        with pytest.raises(InvalidArgument) as e:
            client.complete("strict", CONVERSATION, max_tokens=2)
        assert "no system messages here" in e.value.message
        assert e.value.violations[0].field == "messages"
        out = client.complete("strict", CONVERSATION[1:], max_tokens=2, ignore_eos=True)
        assert out.final.finish_reason == "length"
