"""The request pipeline (prepare, admit, route, attempt, fail over, output) on workers
whose transport is a script (tests/fake_worker.py): what the client sees when workers
fail before, during or instead of a generation. No server, no process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from switchyard.v1 import common_pb2, generation_pb2

from control.config import ModelSpec
from control.errors import InvalidArgument, Overloaded, WorkerFailed
from control.fleet.models import ModelEntry
from control.request.prepare import prepare
from control.request.run import Progress
from control.request.samples import run_samples
from control.text.params import parse_request
from control.text.tokenizer import Tokenizer
from control.workers.client import WorkerClient
from control.workers.state import Capabilities, WorkerInfo
from switchyard_common.rpc_status import FieldViolation
from tests.fake_worker import FakeTransport, Script, fails, rpc_error, tokens

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(str(tiny_model_dir))


class Fleet:
    """A model whose workers answer from scripts, tried in order (round robin)."""

    def __init__(self, tok: Tokenizer, *scripts: Script) -> None:
        self.transports = [FakeTransport(s) for s in scripts]
        self.workers = [
            WorkerClient(f"fake:{i}", transport=t) for i, t in enumerate(self.transports)
        ]
        info = WorkerInfo(
            engine="fake",
            engine_version="1",
            model="tiny",
            max_context=256,
            vocab_size=tok.vocab_size,
            eos_token_ids=(1,),
            kv_block_size=16,
            capabilities=Capabilities(max_logprobs=5, resume_tokens=True),
        )
        for w in self.workers:
            w.info = info
            w.set_serving(True)
        spec = ModelSpec(name="fake", engine="sim", model="builtin:tiny", routing="round_robin")
        self.entry = ModelEntry(spec=spec, tokenizer=tok, info=info, workers=self.workers)

    async def generate(self, **fields: Any) -> tuple[str, list[int], generation_pb2.Final]:
        """The text, token ids and Final the client gets."""
        req = generation_pb2.GenerateRequest(model="fake", text="Hello", **fields)
        prepared = await prepare(self.entry, parse_request(req), time.perf_counter(), 10.0)
        progress = Progress()
        text, ids, finals = "", [], []
        self.sizes: list[int] = []  # the tokens of each chunk the client got
        async for msg in run_samples(prepared, progress):
            if msg.HasField("chunk"):
                text += msg.chunk.text
                ids += msg.chunk.token_ids
                self.sizes.append(len(msg.chunk.token_ids))
            else:
                finals.append(msg.final)
        assert progress.over and len(finals) == 1
        return text, ids, finals[0]

    async def close(self) -> None:
        for w in self.workers:
            assert (w.in_flight, w.in_flight_tokens, w.prefill_tokens) == (0, 0, 0)
            await w.close()


@pytest.fixture
async def words(tok: Tokenizer) -> list[int]:
    return tok.encode(" Hello world. Stop here and more text", False)


async def test_a_worker_that_fails_before_any_token_is_replaced_unseen(
    tok: Tokenizer, words: list[int]
) -> None:
    fleet = Fleet(tok, fails(rpc_error(UNAVAILABLE, "gone")), tokens(words))
    text, ids, final = await fleet.generate(stopping={"max_tokens": 4})
    assert ids == words[:4] and text == tok.decode(words[:4], True)
    assert final.worker == "fake:1" and not final.resumed_after_tokens
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(fleet.transports[0].requests) == 1  # it was tried
    await fleet.close()


async def test_a_worker_that_fails_mid_stream_is_resumed_after_its_tokens(
    tok: Tokenizer, words: list[int]
) -> None:
    fleet = Fleet(tok, tokens(words[:3], then=rpc_error(UNAVAILABLE)), tokens(words[3:]))
    text, ids, final = await fleet.generate(stopping={"max_tokens": 6})
    assert ids == words[:6] and text == tok.decode(words[:6], True)  # one stream
    assert list(final.resumed_after_tokens) == [3] and final.worker == "fake:1"
    resumed = fleet.transports[1].requests[0]
    assert list(resumed.resume_token_ids) == words[:3] and resumed.max_tokens == 3
    assert final.usage.completion_tokens == 6
    await fleet.close()


async def test_stream_interval_merges_a_workers_chunks_after_the_first(
    tok: Tokenizer, words: list[int]
) -> None:
    """A worker that sends one token a chunk (it keeps no cadence itself): the client
    still gets the first token at once, then chunks of the interval, the rest last; the
    worker is asked for the cadence too."""
    fleet = Fleet(tok, tokens(words))
    text, ids, final = await fleet.generate(
        stopping={"max_tokens": 8}, output={"stream_interval": 3}
    )
    assert fleet.sizes == [1, 3, 3, 1]
    assert ids == words[:8] and text == tok.decode(words[:8], True)
    assert fleet.transports[0].requests[0].stream_interval == 3
    assert final.usage.completion_tokens == 8
    await fleet.close()


async def test_tokens_held_for_the_cadence_survive_a_worker_failure(
    tok: Tokenizer, words: list[int]
) -> None:
    fleet = Fleet(tok, tokens(words[:3], then=rpc_error(UNAVAILABLE)), tokens(words[3:]))
    text, ids, _ = await fleet.generate(stopping={"max_tokens": 7}, output={"stream_interval": 4})
    assert ids == words[:7] and text == tok.decode(words[:7], True)
    assert list(fleet.transports[1].requests[0].resume_token_ids) == words[:3]
    assert sum(fleet.sizes) == 7 and fleet.sizes[0] == 1
    await fleet.close()


async def test_a_stop_string_inside_held_tokens_still_cuts_the_text(
    tok: Tokenizer, words: list[int]
) -> None:
    fleet = Fleet(tok, tokens(words))
    text, _, final = await fleet.generate(
        stopping={"stop": ["here"]}, output={"stream_interval": 5}
    )
    assert text == " Hello world. Stop " and final.stop_string == "here"
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    await fleet.close()


async def test_a_stop_string_ends_the_stream_and_cancels_the_worker(
    tok: Tokenizer, words: list[int]
) -> None:
    fleet = Fleet(tok, tokens(words))
    text, _, final = await fleet.generate(stopping={"stop": ["here"]})
    assert text == " Hello world. Stop " and final.stop_string == "here"
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert fleet.transports[0].cancelled == 1
    await fleet.close()


async def test_a_rejected_request_names_the_public_field_and_goes_nowhere_else(
    tok: Tokenizer, words: list[int]
) -> None:
    bad = rpc_error(
        grpc.StatusCode.INVALID_ARGUMENT, "no", [FieldViolation("max_tokens", "too many")]
    )
    fleet = Fleet(tok, fails(bad), tokens(words))
    with pytest.raises(InvalidArgument) as err:
        await fleet.generate()
    assert [v.field for v in err.value.violations] == ["stopping.max_tokens"]
    assert not fleet.transports[1].requests
    await fleet.close()


async def test_every_worker_full_is_overloaded_with_the_workers_hint(tok: Tokenizer) -> None:
    full = fails(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", retry_after_s=2.5))
    fleet = Fleet(tok, full, full)
    with pytest.raises(Overloaded) as err:
        await fleet.generate()
    assert err.value.retry_after_s == 2.5
    assert [len(t.requests) for t in fleet.transports] == [1, 1]
    await fleet.close()


async def test_an_engine_failure_is_retried_once_then_reported(tok: Tokenizer) -> None:
    broken = fails(rpc_error(grpc.StatusCode.INTERNAL, "CUDA went away"))
    fleet = Fleet(tok, broken, broken, broken)
    with pytest.raises(WorkerFailed, match="CUDA went away"):
        await fleet.generate()
    assert sorted(len(t.requests) for t in fleet.transports) == [0, 1, 1]  # one retry
    await fleet.close()


async def test_a_client_that_leaves_frees_the_worker_at_once(
    tok: Tokenizer, words: list[int]
) -> None:
    fleet = Fleet(tok, tokens(words))
    req = generation_pb2.GenerateRequest(model="fake", text="Hello")
    prepared = await prepare(fleet.entry, parse_request(req), time.perf_counter(), 10.0)
    stream: AsyncIterator[Any] = run_samples(prepared, Progress())
    await anext(stream)
    assert fleet.workers[0].in_flight == 1
    await stream.aclose()  # type: ignore[attr-defined]
    assert fleet.transports[0].cancelled == 1
    await fleet.close()  # nothing left in flight


async def test_samples_that_a_worker_rejects_name_the_prompt_field_the_client_sent(
    tok: Tokenizer,
) -> None:
    """n > 1: the prompt is tokenized once and each sample sent as token ids, but a
    worker's complaint about them names the field the client set (`text`)."""
    bad = rpc_error(
        grpc.StatusCode.INVALID_ARGUMENT, "no", [FieldViolation("prompt_token_ids", "too long")]
    )
    fleet = Fleet(tok, fails(bad))
    with pytest.raises(InvalidArgument) as err:
        await fleet.generate(n=2)
    assert {v.field for v in err.value.violations} == {"text"}
    await fleet.close()
