"""StreamedRequest against a fake AsyncLLM: the interleavings a real engine rarely shows
(outputs before the collector is taken over, a cancel or the deadline while the request
is being added, a fault of ours inside vLLM's output handler). Every request ends once,
is aborted when it did not finish, and is released."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from switchyard.v1 import common_pb2
from switchyard.worker.v1 import worker_pb2

from pyworker.load import InFlight
from pyworker.relay import StreamedRequest
from pyworker.request import ParsedGenerate


class Collector:
    """vLLM's RequestOutputCollector, as far as the relay uses it."""

    def __init__(self) -> None:
        self.output: Any = None

    def put(self, output: Any) -> None:
        self.output = output


class FakeLLM:
    def __init__(self) -> None:
        self.collector = Collector()
        self.added = asyncio.Event()
        self.release_add = asyncio.Event()
        self.release_add.set()
        self.aborted: list[str] = []

    async def add_request(self, request_id: str, prompt: Any, params: Any, **kw: Any) -> Any:
        self.added.set()
        await self.release_add.wait()
        return self.collector

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


class FakeGenerations:
    def __init__(self, llm: FakeLLM) -> None:
        self.engine = SimpleNamespace(
            llm=llm, make_prompt=lambda ids: ids, trace_headers=lambda headers: headers
        )
        self.released: list[str] = []
        self.tasks: set[asyncio.Task[None]] = set()

    def final_for(
        self, parsed: Any, state: Any, completion: Any, last: Any, guard: Any = None
    ) -> Any:
        return worker_pb2.Final(finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async def check_resume(self, parsed: Any) -> None:
        return None  # none of these requests is a resumed constrained one

    def count_tokens(self, n: int) -> None:
        pass

    def keep(self, task: asyncio.Task[None]) -> None:
        self.tasks.add(task)

    def release(self, state: InFlight) -> None:
        self.released.append(state.request_id)


class Sink:
    def __init__(self, fail_on_final: bool = False) -> None:
        self.events: list[tuple[str, Any]] = []
        self.fail_on_final = fail_on_final
        self.got = asyncio.Event()

    def chunk(self, token_ids: list[int], logprobs: Any, prompt: Any = None) -> None:
        self.events.append(("chunk", list(token_ids)))

    def final(self, final: Any) -> None:
        if self.fail_on_final:
            raise RuntimeError("a fault of ours")
        self.events.append(("final", final.finish_reason))
        self.got.set()

    def error(self, exc: Any) -> None:
        self.events.append(("error", exc.code.name))


def output(tokens: list[int], finished: bool = False) -> Any:
    completion = SimpleNamespace(token_ids=tokens, logprobs=None, finish_reason=None)
    return SimpleNamespace(outputs=[completion], finished=finished, num_cached_tokens=0)


def make(
    llm: FakeLLM, sink: Sink, deadline: float | None = None
) -> tuple[StreamedRequest, FakeGenerations]:
    gens = FakeGenerations(llm)
    parsed = ParsedGenerate(
        prompt_token_ids=[1, 2],
        sampling_params=None,
        logprobs=None,
        priority=0,
        stop_token_ids=frozenset(),
    )
    state = InFlight("r1", prompt_tokens=2)
    req = StreamedRequest(gens, parsed, state, sink, 0.0, deadline)  # type: ignore[arg-type]
    return req, gens


async def settle(req: StreamedRequest, gens: FakeGenerations) -> None:
    async with asyncio.timeout(5):
        await req.done
        while gens.tasks:
            await asyncio.gather(*gens.tasks)
            gens.tasks = {t for t in gens.tasks if not t.done()}


async def test_an_output_put_before_the_take_over_is_not_lost() -> None:
    llm = FakeLLM()
    llm.collector.put(output([5, 6]))  # the handler ran during add_request
    sink = Sink()
    req, gens = make(llm, sink)
    await req.start()
    llm.collector.put(output([7], finished=True))
    await settle(req, gens)
    assert sink.events == [
        ("chunk", [5, 6]),
        ("chunk", [7]),
        ("final", common_pb2.FINISH_REASON_LENGTH),
    ]
    assert gens.released == ["r1"] and llm.aborted == []  # finished: nothing to abort


async def test_a_cancel_while_adding_aborts_once_vllm_has_it() -> None:
    llm = FakeLLM()
    llm.release_add.clear()
    sink = Sink()
    req, gens = make(llm, sink)
    start = asyncio.create_task(req.start())
    await llm.added.wait()
    req.cancel()
    assert llm.aborted == [] and not req.done.done()  # vLLM may not know it yet
    llm.release_add.set()
    await start
    await settle(req, gens)
    assert llm.aborted == ["r1"] and gens.released == ["r1"] and sink.events == []


async def test_the_deadline_while_adding_ends_with_time_limit_then_aborts() -> None:
    import time

    llm = FakeLLM()
    llm.release_add.clear()
    sink = Sink()
    req, gens = make(llm, sink, deadline=time.monotonic() + 0.01)
    start = asyncio.create_task(req.start())
    async with asyncio.timeout(5):  # the deadline falls while vLLM is still adding it
        await sink.got.wait()
    assert sink.events == [("final", common_pb2.FINISH_REASON_TIME_LIMIT)]
    assert llm.aborted == []
    llm.release_add.set()
    await start
    await settle(req, gens)
    assert llm.aborted == ["r1"] and gens.released == ["r1"]


async def test_a_fault_of_ours_in_the_output_handler_still_releases_and_escapes_nothing() -> None:
    llm = FakeLLM()
    sink = Sink(fail_on_final=True)
    req, gens = make(llm, sink)
    await req.start()
    llm.collector.put(output([5], finished=True))  # would raise into vLLM's handler
    await settle(req, gens)
    assert gens.released and req.done.done()
