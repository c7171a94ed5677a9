"""The policy interface and what a policy may look at."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from control.routing.kv_index import KvIndex


class Candidate(Protocol):
    """A worker as a policy sees it."""

    @property
    def address(self) -> str: ...
    @property
    def running(self) -> int: ...  # as the worker last reported
    @property
    def waiting(self) -> int: ...
    @property
    def in_flight(self) -> int: ...  # requests this control plane has on it now
    @property
    def in_flight_tokens(self) -> int: ...  # their prompt plus remaining output tokens
    @property
    def in_flight_at_report(self) -> int: ...  # in_flight when the latest report came
    @property
    def prefill_tokens(self) -> int: ...  # prompt tokens of those with no token back yet


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_ids: Sequence[int]
    max_tokens: int
    kv_block_size: int = 16
    adapter: str = ""  # the LoRA adapter: its blocks are not the base model's


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate: ...


# How many in-flight tokens weigh as much as one running request.
TOKENS_PER_REQUEST_WEIGHT = 1024


def load_score(c: Candidate) -> float:
    """Lower is less loaded. The worker's report counts every caller's requests but lags
    by up to one interval; this process's own requests since then (sent, less ended) are
    exact, so they correct it at once (before, with several router processes, a router's
    own new requests counted only through the token weight until the next report).
    Never less than this process's own count; plus the token weight."""
    since = c.in_flight - c.in_flight_at_report
    requests = max(c.running + c.waiting + since, c.in_flight)
    return requests + c.in_flight_tokens / TOKENS_PER_REQUEST_WEIGHT


@runtime_checkable
class IndexedPolicy(Protocol):
    """A policy that routes by an index of the blocks each worker holds. With
    `follows_events`, the control plane feeds the index its workers' KV-cache events;
    without, the policy learns it from the prompts it routes alone."""

    name: str
    index: KvIndex
    follows_events: bool

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate: ...
