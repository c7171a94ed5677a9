"""Resuming a stream on another worker after its worker failed mid-stream, without
breaking what the request asked for.

The caller has the tokens generated so far; the next worker continues after them. What a
resumed request keeps, and how:

- The tokens so far go to the worker apart from the prompt (`resume_token_ids`), so that
  it continues the output rather than answering a longer prompt. A worker from before that
  field (its Capabilities do not say `resume_tokens`) is sent them at the end of the prompt.
- A constraint holds over the whole output only where the worker continues its grammar
  past those tokens (`Capabilities.resumable_constraints`). A constrained stream goes only
  to such a worker; with none, it ends UNAVAILABLE (`NotResumable`) saying after how many
  tokens and why, never OK with output that breaks its constraint.
- A seed cannot replay the failed worker's random state. The resumed part is sampled with
  `resume_seed(seed, tokens so far)`: the same failure at the same token gives the same
  output again, and a resumed stream never repeats the start of its own sampling.
- max_tokens, min_tokens, stop strings and stop tokens count across the boundary (the
  run keeps them); logprobs continue for the resumed tokens; usage counts each token once.
"""

from __future__ import annotations

from switchyard.worker.v1 import worker_pb2

from control.errors import NotResumable
from control.text.params import GenerationParams
from control.workers.call import WorkerCallFailed
from control.workers.state import WorkerState

_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / the golden ratio: offsets spread over the seeds


def resume_seed(seed: int, tokens_so_far: int) -> int:
    """The seed of a request resumed after `tokens_so_far` tokens: a function of both
    (so a failure at the same point gives the same output), and `seed` itself at 0."""
    return (seed + tokens_so_far * _GOLDEN) % 2**64


def can_resume(worker: WorkerState, params: GenerationParams) -> bool:
    """Whether `worker` can continue this request's output as the request asked."""
    constraint = params.constraint
    if constraint is None:
        return True
    caps = worker.info.capabilities if worker.info is not None else None
    return caps is not None and constraint.kind in caps.resumable_constraints


def resume_request(
    wreq: worker_pb2.GenerateRequest,
    worker: WorkerState,
    prompt_ids: list[int],
    generated: list[int],
    params: GenerationParams,
) -> None:
    """Make `wreq` (built for the prompt) continue after `generated` on `worker`."""
    caps = worker.info.capabilities if worker.info is not None else None
    if caps is not None and caps.resume_tokens:
        wreq.resume_token_ids.extend(generated)
    else:  # a worker from before resume_token_ids: the tokens so far end its prompt
        del wreq.prompt_token_ids[:]
        wreq.prompt_token_ids.extend(prompt_ids)
        wreq.prompt_token_ids.extend(generated)
    if params.sampling.seed is not None:
        wreq.sampling.seed = resume_seed(params.sampling.seed, len(generated))
    wreq.ClearField("prompt_logprobs")  # the caller has them from the first worker


def not_resumable_anywhere(
    entry_name: str, params: GenerationParams, tokens: int, failure: WorkerCallFailed | None
) -> NotResumable:
    """No healthy worker of the model can continue this constrained stream."""
    assert params.constraint is not None
    kind = params.constraint.kind
    return NotResumable(
        tokens,
        said(failure),
        f"no healthy worker of model {entry_name!r} can continue a {kind} constraint "
        f"mid-output (its output must stay valid against the constraint; "
        f"Capabilities.resumable_constraints of its workers do not list {kind})",
    )


def refused_resume(
    tokens: int, failure: WorkerCallFailed, last: WorkerCallFailed | None
) -> NotResumable:
    """The worker chosen to continue the stream refused to (before any new token)."""
    return NotResumable(
        tokens, said(last), f"worker {failure.worker} refused to continue it: {failure.message}"
    )


def said(failure: WorkerCallFailed | None) -> str:
    if failure is None:
        return "its worker failed"
    return f"worker {failure.worker}: {failure.kind.value}: {failure.message}"
