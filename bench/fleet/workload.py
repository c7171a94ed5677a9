"""The fleet simulation's traffic: token-id prompts with arrival times, seeded.

Two workloads, both open loop (arrivals never wait for completions):

- `WorkloadSpec` ("groups"): each request is one of `groups` system prompts plus a unique
  suffix; the shape the routing policies were first tuned on.
- `TenantSpec` ("tenants", the KV-routing traffic): many tenants, each with a system prompt of
  its own length and a Zipf popularity; multi-turn conversations whose every turn is the
  previous turn's prompt, the answer to it and a new user message (so each prompt extends
  an earlier one); and a share of one-off prompts that share nothing.

A prompt is stored as the segments it is made of (shared arrays), joined on use.
"""

from __future__ import annotations

import heapq
import random
from array import array
from dataclasses import dataclass
from itertools import chain

from control.routing.kv_index import prompt_keys

FIRST_ORDINARY_TOKEN = 4  # the simulator leaves ids below this to special tokens


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Shared-prefix traffic: each request is its group's system prompt plus a unique
    suffix. Group popularity is Zipf with exponent `zipf` (0 is uniform)."""

    requests: int = 20000
    rate: float = 1000.0  # requests per second, Poisson; about round_robin's capacity
    groups: int = 128
    zipf: float = 0.0
    prefix_tokens: int = 512
    suffix_tokens: tuple[int, int] = (32, 128)
    output_tokens: tuple[int, int] = (64, 256)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """Tenants' conversations and one-off prompts (the module's docstring)."""

    requests: int = 6000
    rate: float = 600.0  # requests per second over all sessions
    tenants: int = 48
    tenant_zipf: float = 1.0  # tenant popularity
    system_tokens: tuple[int, int] = (256, 1024)
    turns: tuple[int, int] = (1, 8)  # per conversation, uniform
    user_tokens: tuple[int, int] = (32, 160)
    output_tokens: tuple[int, int] = (64, 256)
    think_s: float = 3.0  # mean pause after an answer, exponential
    answer_s_per_token: float = 0.01  # how long the answer is taken to stream
    unique_share: float = 0.15  # of requests: one-off prompts, no system prompt
    unique_tokens: tuple[int, int] = (256, 1024)
    max_prompt_tokens: int = 3500  # a conversation ends before its prompt grows past this
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Workload:
    spec: WorkloadSpec | TenantSpec
    arrival_us: array[float]
    parts: list[tuple[array[int], ...]]  # each request's prompt, as segments
    max_tokens: array[int]
    tenant: array[int]  # its group or tenant; -1 for a one-off prompt
    turn: array[int]  # 0 for a conversation's first request (and for every other kind)

    @property
    def requests(self) -> int:
        return len(self.arrival_us)

    def prompt(self, k: int) -> list[int]:
        return list(chain.from_iterable(self.parts[k]))

    def prompt_len(self, k: int) -> int:
        return sum(len(p) for p in self.parts[k])


def _tokens(rng: random.Random, n: int, vocab_size: int) -> array[int]:
    return array("i", rng.choices(range(FIRST_ORDINARY_TOKEN, vocab_size), k=n))


def make_workload(spec: WorkloadSpec | TenantSpec, vocab_size: int = 32000) -> Workload:
    if isinstance(spec, TenantSpec):
        return _tenants(spec, vocab_size)
    rng = random.Random(spec.seed)
    prefixes = [_tokens(rng, spec.prefix_tokens, vocab_size) for _ in range(spec.groups)]
    weights = [1.0 / (g + 1) ** spec.zipf for g in range(spec.groups)]
    arrival_us: array[float] = array("d")
    group: array[int] = array("i")
    parts: list[tuple[array[int], ...]] = []
    max_tokens: array[int] = array("i")
    t = 0.0
    for _ in range(spec.requests):
        t += rng.expovariate(spec.rate) * 1e6
        arrival_us.append(t)
        g = rng.choices(range(spec.groups), weights)[0]
        group.append(g)
        suffix = _tokens(rng, rng.randint(*spec.suffix_tokens), vocab_size)
        parts.append((prefixes[g], suffix))
        max_tokens.append(rng.randint(*spec.output_tokens))
    turn = array("i", bytes(4 * spec.requests))
    return Workload(spec, arrival_us, parts, max_tokens, group, turn)


def _tenants(spec: TenantSpec, vocab_size: int) -> Workload:
    rng = random.Random(spec.seed)
    systems = [
        _tokens(rng, rng.randint(*spec.system_tokens), vocab_size) for _ in range(spec.tenants)
    ]
    weights = [1.0 / (t + 1) ** spec.tenant_zipf for t in range(spec.tenants)]
    mean_turns = sum(spec.turns) / 2
    u = spec.unique_share
    # The share of sessions that are one-off prompts, so that `u` of requests are.
    one_off = u * mean_turns / (1 - u + u * mean_turns) if u < 1 else 1.0
    session_rate = spec.rate / (one_off + (1 - one_off) * mean_turns)
    # (arrival µs, sequence, parts, max_tokens, tenant, turn), generated past the end
    # and cut to the first `requests` arrivals
    pending: list[tuple[float, int, tuple[array[int], ...], int, int, int]] = []
    seq = 0
    t = 0.0
    sessions = 0
    while True:
        # Every session starting before `t` has all its turns here: once `requests` of
        # them arrive by `t`, the first `requests` arrivals are final.
        sessions += 1
        if sessions % 256 == 0 and sum(r[0] <= t for r in pending) >= spec.requests:
            break
        t += rng.expovariate(session_rate) * 1e6
        if rng.random() < one_off:
            prompt = _tokens(rng, rng.randint(*spec.unique_tokens), vocab_size)
            pending.append((t, seq, (prompt,), rng.randint(*spec.output_tokens), -1, 0))
            seq += 1
            continue
        tenant = rng.choices(range(spec.tenants), weights)[0]
        history: tuple[array[int], ...] = (systems[tenant],)
        at = t
        for i in range(rng.randint(*spec.turns)):
            user = _tokens(rng, rng.randint(*spec.user_tokens), vocab_size)
            out = rng.randint(*spec.output_tokens)
            parts = (*history, user)
            if sum(map(len, parts)) + out > spec.max_prompt_tokens:
                break
            pending.append((at, seq, parts, out, tenant, i))
            seq += 1
            answer = _tokens(rng, out, vocab_size)  # what the model said, as the next turn sees it
            history = (*parts, answer)
            at += (out * spec.answer_s_per_token + rng.expovariate(1 / spec.think_s)) * 1e6
    first = heapq.nsmallest(spec.requests, pending)
    return Workload(
        spec,
        array("d", (r[0] for r in first)),
        [r[2] for r in first],
        array("i", (r[3] for r in first)),
        array("i", (r[4] for r in first)),
        array("i", (r[5] for r in first)),
    )


def describe(spec: WorkloadSpec | TenantSpec) -> str:
    """The workload in a sentence or three, for a report."""
    lo_o, hi_o = spec.output_tokens
    if isinstance(spec, WorkloadSpec):
        head = (
            f"{spec.requests} requests, Poisson arrivals at {spec.rate:g} requests/s "
            f"(seed {spec.seed}), each asking for {lo_o}-{hi_o} output tokens."
        )
        lo_s, hi_s = spec.suffix_tokens
        popularity = "uniform" if spec.zipf == 0 else f"Zipf, exponent {spec.zipf}"
        return (
            f"{head} {spec.groups} prefix groups ({popularity}), each a "
            f"{spec.prefix_tokens}-token system prompt; a request is its group's prefix plus "
            f"a unique {lo_s}-{hi_s} token suffix."
        )
    head = (
        f"{spec.requests} requests (seed {spec.seed}), each asking for {lo_o}-{hi_o} output "
        f"tokens. Conversations and one-off prompts start as a Poisson process, at "
        f"{spec.rate:g} requests/s in all on average; a conversation's later turns follow "
        f"its pauses."
    )
    lo_y, hi_y = spec.system_tokens
    lo_t, hi_t = spec.turns
    lo_u, hi_u = spec.user_tokens
    lo_q, hi_q = spec.unique_tokens
    return (
        f"{head} {spec.tenants} tenants (popularity Zipf, exponent {spec.tenant_zipf:g}), "
        f"each with a system prompt of {lo_y}-{hi_y} tokens. A conversation has {lo_t}-{hi_t} "
        f"turns (while its prompt stays under {spec.max_prompt_tokens} tokens); each turn's "
        f"prompt is the previous turn's prompt, its answer and a new {lo_u}-{hi_u} token "
        f"message, arriving {spec.answer_s_per_token * 1000:g} ms per answer token plus a "
        f"pause (exponential, mean {spec.think_s:g} s) after the previous turn. "
        f"{spec.unique_share:.0%} of requests are one-off prompts of {lo_q}-{hi_q} tokens "
        f"that share nothing."
    )


def reuse_ceiling(workload: Workload, block_size: int) -> tuple[int, int]:
    """(cached, prompt) tokens if every request found cached every full block that an
    earlier request's prompt computed: one cache that never evicts. No routing over caches
    of any size does better. The last prompt token is always computed (the simulator's
    count; vLLM's, in whole blocks, can be a block less)."""
    seen: set[int] = set()
    cached = total = 0
    for k in range(workload.requests):
        prompt = workload.prompt(k)
        keys = prompt_keys(prompt, block_size)
        hit = 0
        while hit < len(keys) and keys[hit] in seen:
            hit += 1
        seen.update(keys)
        cached += min(hit * block_size, len(prompt) - 1)
        total += len(prompt)
    return cached, total
