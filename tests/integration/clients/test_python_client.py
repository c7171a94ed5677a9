"""`switchyard.client` against a real control plane (C++ simulator workers): typed chunks
and errors, retries before the first token, deadlines, tokens, and a stream that its
caller stops iterating cancelled on the server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from switchyard.client import (
    NO_RETRY,
    AsyncClient,
    Chunk,
    Client,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    RetryPolicy,
    Unauthenticated,
)
from tests.procs import Proc, serving_control

TOKEN = "client-test-secret-0123456789"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("client")
    tokens = tmp / "tokens.yaml"
    tokens.write_text(f"tokens: [{{name: tests, token: {TOKEN}, scopes: [generate, admin]}}]\n")
    models = (
        "  - name: sim\n"
        "    engine: sim\n"
        "    model: builtin:tiny\n"
        "    engine_args: {decode_step_us: 1000}\n"
        "  - name: one-at-a-time\n"  # a full model: RESOURCE_EXHAUSTED while one runs
        "    engine: sim\n"
        "    model: builtin:tiny\n"
        "    engine_args: {decode_step_us: 1000}\n"
        "    limits: {max_concurrency: 1, max_queue: 0}\n"
    )
    settings = f"auth: {{tokens_file: {tokens}}}\n"
    with serving_control(tmp, models, "one-at-a-time", settings=settings, timeout=120) as proc:
        yield proc


@pytest.fixture
def client(plane: Proc) -> Iterator[Client]:
    with Client(plane.address, token=TOKEN, timeout=30) as c:
        yield c


def in_flight(client: Client) -> int:
    return sum(w.in_flight for w in client.workers())


def wait_idle(client: Client, timeout: float = 10) -> float:
    started = time.monotonic()
    while in_flight(client):
        assert time.monotonic() - started < timeout, "the call was not cancelled"
        time.sleep(0.02)
    return time.monotonic() - started


def test_streams_typed_chunks_then_the_final(client: Client) -> None:
    stream = client.generate("sim", "Hello", max_tokens=12, ignore_eos=True, temperature=0)
    chunks = list(stream)
    assert chunks and all(isinstance(c, Chunk) for c in chunks)
    assert stream.final is not None
    assert stream.final.finish_reason == "length"
    assert stream.final.usage.completion_tokens == 12 == sum(len(c.token_ids) for c in chunks)
    whole = client.complete("sim", "Hello", max_tokens=12, ignore_eos=True, temperature=0)
    assert whole.text == "".join(c.text for c in chunks)
    assert whole.token_ids == tuple(t for c in chunks for t in c.token_ids)
    assert sorted(m.name for m in client.models()) == ["one-at-a-time", "sim"]
    assert client.tokenize("sim", "Hello").token_ids


def test_errors_are_typed_with_their_details(client: Client) -> None:
    with pytest.raises(InvalidArgument) as bad:
        list(client.generate("sim", "Hello", temperature=-1.0))
    assert [v.field for v in bad.value.violations] == ["sampling.temperature"]
    with pytest.raises(NotFound) as missing:
        client.complete("no-such-model", "Hello")
    assert missing.value.resource == ("model", "no-such-model")
    with Client(client.address, timeout=10) as anonymous, pytest.raises(Unauthenticated):
        anonymous.models()


def test_a_full_model_is_retried_after_the_servers_delay(client: Client) -> None:
    holder = client.generate("one-at-a-time", "Hi", max_tokens=600, ignore_eos=True)
    assert next(holder).token_ids  # it holds the only slot for about 0.6 s
    with Client(client.address, token=TOKEN, retry=NO_RETRY) as once:
        with pytest.raises(ResourceExhausted) as full:
            once.complete("one-at-a-time", "Hi", max_tokens=2)
    assert full.value.retry_after_s is not None and full.value.retry_after_s > 0
    done = threading.Thread(target=lambda: list(holder))
    done.start()
    patient = RetryPolicy(max_attempts=50, initial_backoff_s=0.05)
    with Client(client.address, token=TOKEN, retry=patient) as retrying:
        out = retrying.complete("one-at-a-time", "Hi", max_tokens=2, ignore_eos=True)
    done.join()
    assert out.final.usage.completion_tokens == 2
    assert holder.final is not None and holder.final.usage.completion_tokens == 600


def test_stopping_iteration_cancels_the_call_and_deadlines_end_it(client: Client) -> None:
    stream = client.generate("sim", "Hello", max_tokens=4000, ignore_eos=True)
    assert next(stream).token_ids
    assert in_flight(client) == 1
    stream.close()  # 4 s of generation left; the server hears the cancel at once
    assert wait_idle(client) < 2
    for _chunk in client.generate("sim", "Hello", max_tokens=4000, ignore_eos=True):
        break  # leaving the loop closes the stream when it is collected
    assert wait_idle(client) < 2
    deadline = client.complete("sim", "Hello", max_tokens=4000, ignore_eos=True, timeout=0.5)
    assert deadline.final.finish_reason == "time_limit"
    assert 0 < deadline.final.usage.completion_tokens < 4000


def test_the_asyncio_client(plane: Proc, client: Client) -> None:
    async def run() -> None:
        async with AsyncClient(plane.address, token=TOKEN, timeout=30) as ac:
            stream = ac.generate("sim", "Hello", max_tokens=8, ignore_eos=True, temperature=0)
            chunks = [c async for c in stream]
            assert stream.final is not None and stream.final.usage.completion_tokens == 8
            done = await ac.complete("sim", "Hello", max_tokens=8, ignore_eos=True, temperature=0)
            assert done.text == "".join(c.text for c in chunks)
            with pytest.raises(InvalidArgument) as bad:
                await ac.complete("sim", "Hello", top_p=2.0)
            assert [v.field for v in bad.value.violations] == ["sampling.top_p"]
            long = ac.generate("sim", "Hello", max_tokens=4000, ignore_eos=True)
            async for _ in long:
                break
            await long.aclose()
            assert sorted(m.name for m in await ac.models()) == ["one-at-a-time", "sim"]

    asyncio.run(run())
    assert wait_idle(client) < 2
