"""Several samples of one prompt (`GenerateRequest.n`).

The control plane fans them out as n engine requests, on every engine alike, so that the
answer does not depend on which engine serves the model: sample i is the request with n = 1
and, when the caller gave a seed, seed + i (so sample 0 is exactly the n = 1 answer). The
prompt is tokenized once; each sample is admitted, routed, failed over and counted like a
request of its own. Their messages interleave on the one stream, each chunk and Final
marked with its sample's index; the last Final carries the usage of all of them. Closing
the stream (a cancel, a deadline, a client error of one sample) cancels every sample.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from opentelemetry.context import Context
from switchyard.v1 import common_pb2, generation_pb2

from control.request.direct import ChunkSink
from control.request.prepare import PreparedRequest
from control.request.run import Progress, TokenBudget, run_generation

_Item = tuple[int, generation_pb2.GenerateResponse | BaseException | None]
# Messages of all samples waiting for the caller: a slow reader holds the samples back
# (and through them the workers' streams) instead of growing this without bound.
QUEUE_PER_SAMPLE = 4


async def run_samples(
    prepared: PreparedRequest,
    progress: Progress,
    trace: Context | None = None,
    budget: TokenBudget | None = None,
    sink: ChunkSink | None = None,
) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
    """`run_generation` for n samples (n = 1 is run_generation itself, with `sink`);
    `progress.over` is set as the last sample's Final goes out."""
    n = prepared.params.n
    if n <= 1:
        gen = run_generation(prepared, progress, trace, budget, sink)
        async with contextlib.aclosing(gen):
            async for msg in gen:
                yield msg
        return
    queue: asyncio.Queue[_Item] = asyncio.Queue(maxsize=QUEUE_PER_SAMPLE * n)

    async def one(i: int) -> None:
        gen = run_generation(prepared.sample(i), None, trace, budget)
        try:
            async with contextlib.aclosing(gen):
                async for msg in gen:
                    await queue.put((i, msg))
        except Exception as exc:  # the sample's error ends the request
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    total = common_pb2.Usage(prompt_tokens=len(prepared.prompt_ids))
    finals = running = n
    try:
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.HasField("chunk"):
                item.chunk.index = i
            else:
                final = item.final
                final.index = i
                final.request_id = prepared.params.request_id
                total.completion_tokens += final.usage.completion_tokens
                total.cached_prompt_tokens = max(
                    total.cached_prompt_tokens, final.usage.cached_prompt_tokens
                )
                finals -= 1
                if finals == 0:
                    final.total_usage.CopyFrom(total)
                    progress.over = True
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Collected:
    """A Complete answer, built from a generation's messages: sample 0 at the top (the
    only one when n = 1), and with n > 1 every sample in `choices`, in index order."""

    def __init__(self) -> None:
        self._choices: dict[int, generation_pb2.Choice] = {}
        self._texts: dict[int, list[str]] = {}
        self._prompt_logprobs: list[common_pb2.TokenLogprob] = []
        self._total: common_pb2.Usage | None = None

    def _choice(self, index: int) -> generation_pb2.Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = generation_pb2.Choice(index=index)
            self._texts[index] = []
        return choice

    def add(self, resp: generation_pb2.GenerateResponse) -> None:
        if resp.HasField("chunk"):
            chunk = resp.chunk
            choice = self._choice(chunk.index)
            self._texts[chunk.index].append(chunk.text)
            choice.token_ids.extend(chunk.token_ids)
            choice.logprobs.extend(chunk.logprobs)
            self._prompt_logprobs.extend(chunk.prompt_logprobs)
        else:
            final = resp.final
            self._choice(final.index).final.CopyFrom(final)
            if final.HasField("total_usage"):
                self._total = final.total_usage

    def response(self) -> generation_pb2.CompleteResponse:
        out = generation_pb2.CompleteResponse(prompt_logprobs=self._prompt_logprobs)
        for index, choice in self._choices.items():
            choice.text = "".join(self._texts[index])
        first = self._choices.get(0)
        if first is None:
            return out
        out.text = first.text
        out.token_ids.extend(first.token_ids)
        out.logprobs.extend(first.logprobs)
        out.final.CopyFrom(first.final)
        if len(self._choices) > 1:
            if self._total is not None:
                out.final.total_usage.CopyFrom(self._total)
            out.choices.extend(self._choices[i] for i in sorted(self._choices))
        return out
