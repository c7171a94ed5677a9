"""Which worker holds which KV-cache blocks: the index behind `kv_aware` routing.

A block is keyed by a chained hash of its tokens: block i's key hashes block i-1's key
with block i's token ids (and, for the first, a salt such as a LoRA adapter's name), so
a key stands for the whole prefix up to the end of its block, as an engine's prefix
cache does. Keys are this process's own, computed from token ids; they never depend on
how an engine hashes, so one index serves every engine.

Two ways in:
- `stored` / `removed` / `cleared`: what an engine reports (KV-cache events carry each
  stored block's tokens and the engine's own hash of it; removals name the engine's
  hash only, so each worker's engine hashes map to keys here).
- `learn`: the prompts this process routed (the approximate tree SMG's cache-aware policy
  keeps): the chosen worker is taken to hold the prompt's blocks from then on, until the
  bound pushes them out. This is all there is for a worker that reports nothing. For one
  that reports, a new subscription is first told what the engine holds (the worker keeps
  a mirror); a learned block the engine evicts without this index knowing its engine
  hash stays until the bound pushes it out.

Memory is bounded: at most `max_blocks` (worker, block) entries in all; beyond that the
least recently stored or used go first. `overlap` counts, for each worker, how many of a
prompt's leading blocks it holds.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

ROOT = 0  # the parent key of a prompt's first block


def block_key(parent: int, tokens: Sequence[int], salt: str = "") -> int:
    """The key of a block whose prefix has key `parent` (ROOT for the first block)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    if parent == ROOT and salt:
        h.update(salt.encode())
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))  # each token id, 4 bytes
    return int.from_bytes(h.digest(), "little") or 1  # never ROOT


def prompt_keys(prompt_ids: Sequence[int], block_size: int, salt: str = "") -> list[int]:
    """The keys of the prompt's full blocks, in order (a partial last block is never
    cached, so it has none)."""
    keys: list[int] = []
    parent = ROOT
    size = max(block_size, 1)
    for start in range(0, len(prompt_ids) - size + 1, size):
        parent = block_key(parent, prompt_ids[start : start + size], salt)
        keys.append(parent)
    return keys


class KvIndex:
    """Blocks per worker, bounded; see the module's docstring."""

    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.max_blocks = max_blocks
        self._holders: dict[int, set[str]] = {}  # key -> workers holding it
        self._order: OrderedDict[tuple[str, int], None] = OrderedDict()  # oldest first
        self._by_worker: dict[str, set[int]] = {}  # worker -> keys it holds
        # worker -> engine hash -> key, for removals; bounded by what the engine holds (it
        # reports each removal), not by max_blocks
        self._engine: dict[str, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self._order)

    def workers(self) -> set[str]:
        return {w for w, keys in self._by_worker.items() if keys}

    def held(self, worker: str) -> int:
        """How many blocks the worker holds."""
        return len(self._by_worker.get(worker, ()))

    def holds(self, worker: str, key: int) -> bool:
        return (worker, key) in self._order

    # ---- what engines report -----------------------------------------------------------

    def stored(
        self,
        worker: str,
        engine_hashes: Sequence[int],
        parent_engine_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        salt: str = "",
    ) -> bool:
        """Blocks the engine cached: `token_ids` are all of theirs, `block_size` each,
        following the block the engine calls `parent_engine_hash` (None: the prompt's
        first). False, and nothing stored, when the parent is not known here (an event
        was missed: the caller resynchronises) or the tokens do not fill the blocks."""
        if len(token_ids) != len(engine_hashes) * block_size:
            return False
        by_engine = self._engine.setdefault(worker, {})
        if parent_engine_hash is None:
            parent = ROOT
        else:
            known = by_engine.get(parent_engine_hash)
            if known is None:
                return False
            parent = known
        for i, engine_hash in enumerate(engine_hashes):
            parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size], salt)
            by_engine[engine_hash] = parent
            self._add(worker, parent)
        return True

    def removed(self, worker: str, engine_hashes: Iterable[int]) -> None:
        by_engine = self._engine.get(worker, {})
        for engine_hash in engine_hashes:
            key = by_engine.pop(engine_hash, None)
            if key is not None:
                self._discard(worker, key)

    def cleared(self, worker: str) -> None:
        """The worker holds nothing (its cache was cleared, it restarted, or its events
        had a gap and it will be filled again)."""
        for key in list(self._by_worker.get(worker, ())):
            self._discard(worker, key)
        self._by_worker.pop(worker, None)
        self._engine.pop(worker, None)

    # ---- what this process routed ------------------------------------------------------

    def learn(self, worker: str, keys: Sequence[int]) -> None:
        """The worker now holds these blocks (it was sent a prompt that has them)."""
        for key in keys:
            self._add(worker, key)

    # ---- what routing asks ---------------------------------------------------------------

    def overlap(self, keys: Sequence[int], workers: Iterable[str]) -> Mapping[str, int]:
        """For each of `workers`, how many of the leading `keys` it holds in a row."""
        counts = dict.fromkeys(workers, 0)
        active = set(counts)
        for depth, key in enumerate(keys, start=1):
            active &= self._holders.get(key, set())
            if not active:
                break
            for w in active:
                counts[w] = depth
        return counts

    # ---- the bound -----------------------------------------------------------------------

    def _add(self, worker: str, key: int) -> None:
        entry = (worker, key)
        if entry in self._order:
            self._order.move_to_end(entry)
            return
        self._order[entry] = None
        self._holders.setdefault(key, set()).add(worker)
        self._by_worker.setdefault(worker, set()).add(key)
        while len(self._order) > self.max_blocks:
            old_worker, old_key = next(iter(self._order))
            self._discard(old_worker, old_key)

    def _discard(self, worker: str, key: int) -> None:
        entry = (worker, key)
        if entry not in self._order:
            return
        del self._order[entry]
        self._by_worker[worker].discard(key)
        holders = self._holders[key]
        holders.discard(worker)
        if not holders:
            del self._holders[key]
