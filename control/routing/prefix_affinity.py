"""Prefix affinity: requests whose prompts start with the same KV-cache blocks go to the
same worker, where those blocks are likely cached.

The key is a hash of the prompt's first `blocks` full KV blocks (fewer when the prompt is
shorter; prompts under one block have no affinity and go by least load). Each candidate
gets a rendezvous (highest-random-weight) score for the key, so a worker joining or
leaving moves only its share of keys. The top-scoring worker takes the request unless it
is busy, i.e. its load exceeds the least loaded candidate's by more than `slack` requests
(plus `factor` times that load); then the request goes by least load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from control.routing.base import Candidate, RouteRequest, load_score


def prefix_key(prompt_ids: Sequence[int], block_size: int, blocks: int) -> bytes | None:
    full = min(len(prompt_ids) // max(block_size, 1), blocks)
    if full == 0:
        return None
    n = full * block_size
    return hashlib.blake2b(
        b"".join(t.to_bytes(4, "little") for t in prompt_ids[:n]), digest_size=8
    ).digest()


def _rendezvous(key: bytes, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + address.encode(), digest_size=8).digest(), "big")


class PrefixAffinity:
    name = "prefix_affinity"

    def __init__(self, blocks: int = 4, slack: float = 4.0, factor: float = 0.5) -> None:
        self.blocks = blocks
        self.slack = slack
        self.factor = factor

    def choose(self, candidates: Sequence[Candidate], request: RouteRequest) -> Candidate:
        least = min(candidates, key=load_score)
        key = prefix_key(request.prompt_ids, request.kv_block_size, self.blocks)
        if key is None:
            return least
        preferred = max(candidates, key=lambda c: _rendezvous(key, c.address))
        floor = load_score(least)
        if load_score(preferred) > floor + self.slack + self.factor * floor:
            return least
        return preferred
