"""The state behind the limits that hold for the whole service: each token's rate buckets
(control/api/auth.py) and each model's admission counts (control/fleet/admission.py).

One small protocol, `LimitState`, and two kinds of it:

- `LocalLimits`: in this process's memory. One control-plane process (the default)
  gives each rate limiter and each model's admission one of its own, which is all there
  is to share; unit tests use it too.
- `SharedLimits`: a fixed-layout file that the supervisor of `serve --routers N` creates
  (in a private temporary directory, mode 0600) and every router process maps
  (`mmap`), its path handed to them in `LIMITS_FILE_ENV`. Every read-modify-write is a
  short critical section under `flock` on the file, so N processes count as one.
  Bucket timestamps are `time.monotonic()`, CLOCK_MONOTONIC, which every process of one
  host shares.

The file holds, after a header: a table of processes (their pids); one slot per model
(its name's digest, the running and queued counts of the whole service), found by
linear probing and claimed on first use; each process's share of each model's counts
(what it holds, so that the supervisor can give back the share of a router that died:
`reclaim`); and one slot per token bucket, keyed by the digest of the token's name and
rates (a reload that keeps a token's rates keeps its buckets, new rates start full), also
probed. A bucket slot is never emptied, so probe chains never break; a new bucket takes
a slot on its chain whose bucket has refilled completely since it was last used (a
full bucket is all a new one would be) before a free one. Buckets go by the token's name,
not its secret, as `TokenStore.reload` keeps them: a rotated secret keeps its buckets.

Room: PROCESSES processes at once (the supervisor frees a router's place when it exits),
MODELS model names over the service's life, BUCKETS buckets in use; beyond, an error
names what is full. The lock is held for microseconds, so waiting for it on the event
loop costs nothing that matters; a process killed inside one (the kernel drops its lock)
may leave a count written and its share not yet, one slot off.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

LIMITS_FILE_ENV = "SWITCHYARD_LIMITS_FILE"
# How often a process whose requests wait for a model's slot looks for one freed by
# another process (only while it has waiters).
POLL_S = 0.005

PROCESSES = 256
MODELS = 256
BUCKETS = 4096
_MAGIC = b"SWYLIM01"
_HEADER = struct.Struct("<8sIII")  # magic, processes, models, buckets
_PROC = struct.Struct("<q")  # pid; 0: free
_MODEL = struct.Struct("<16sii")  # name digest (zeros: free), running, queued
_SHARE = struct.Struct("<ii")  # one process's running and queued of one model
_BUCKET = struct.Struct("<16sdddd")  # key (zeros: free), rate, capacity, level, updated
_FREE = bytes(16)
_PROCS_AT = _HEADER.size
_MODELS_AT = _PROCS_AT + PROCESSES * _PROC.size
_SHARES_AT = _MODELS_AT + MODELS * _MODEL.size  # [process][model]
_BUCKETS_AT = _SHARES_AT + PROCESSES * MODELS * _SHARE.size
SIZE = _BUCKETS_AT + BUCKETS * _BUCKET.size


class Admit(enum.Enum):
    RUN = "run"  # a slot was free and nobody waits: run now
    QUEUE = "queue"  # counted as waiting: wait in this process's queue
    FULL = "full"  # the queue is full: refuse


@dataclass(frozen=True, slots=True)
class Bucket:
    """One token bucket: `capacity` at most, refilled at `rate` per second."""

    key: bytes  # 16 bytes; the same in every process for the same token and rates
    rate: float
    capacity: float

    @staticmethod
    def of(name: str, rate: float, capacity: float) -> Bucket:
        return Bucket(hashlib.sha256(name.encode()).digest()[:16], rate, capacity)


class LimitState(Protocol):
    """Token buckets and admission counts, for this process alone or for the whole
    service. Admission counts are per model: running and queued, of the whole service."""

    # How often waiters must look for a slot that another process freed; None where no
    # other process frees one (every slot freed here goes to a waiter here).
    poll_s: float | None

    def take(self, bucket: Bucket, n: float, floor: float, now: float) -> float | None:
        """Refill, then take `n` if at least `floor` is there (the level may go below
        zero); None if taken, else the seconds until `floor` is there."""
        ...

    def give_back(self, bucket: Bucket, n: float) -> None: ...

    def admit(self, model: str, max_running: int, max_queue: int) -> tuple[Admit, int, int]:
        """A newcomer: run if a slot is free and nobody waits anywhere, else wait if the
        queue has room; with the running and queued counts it saw."""
        ...

    def claim(self, model: str, max_running: int) -> bool:
        """One of this process's waiters takes a free slot, if there is one."""
        ...

    def hand_over(self, model: str) -> None:
        """A slot of this process passes to one of its waiters."""
        ...

    def leave_queue(self, model: str) -> None:
        """One of this process's waiters gave up without a slot."""
        ...

    def release(self, model: str) -> None:
        """A slot of this process goes back to the pool."""
        ...


def refill(level: float, updated: float, bucket: Bucket, now: float) -> tuple[float, float]:
    """The level and time after refilling up to `now` (never backwards: another
    process may have written a later time than this one read)."""
    now = max(now, updated)
    return min(bucket.capacity, level + (now - updated) * bucket.rate), now


def _take(level: float, n: float, floor: float, rate: float) -> tuple[float, float | None]:
    if level < floor:
        return level, (floor - level) / rate
    return level - n, None


class _Moves:
    """The changes of the counts that check nothing, in terms of `_add`."""

    def _add(self, model: str, running: int, queued: int) -> None:
        raise NotImplementedError

    def hand_over(self, model: str) -> None:
        self._add(model, 0, -1)

    def leave_queue(self, model: str) -> None:
        self._add(model, 0, -1)

    def release(self, model: str) -> None:
        self._add(model, -1, 0)


class LocalLimits(_Moves):
    """The state in this process's memory."""

    poll_s: float | None = None

    def __init__(self) -> None:
        self._buckets: dict[Bucket, tuple[float, float]] = {}  # level, updated
        self._counts: dict[str, tuple[int, int]] = {}  # running, queued

    def take(self, bucket: Bucket, n: float, floor: float, now: float) -> float | None:
        level, updated = refill(*self._buckets.get(bucket, (bucket.capacity, now)), bucket, now)
        level, wait = _take(level, n, floor, bucket.rate)
        self._buckets[bucket] = (level, updated)
        return wait

    def give_back(self, bucket: Bucket, n: float) -> None:
        if bucket in self._buckets:  # one not there is full
            level, updated = self._buckets[bucket]
            self._buckets[bucket] = (min(bucket.capacity, level + n), updated)

    def admit(self, model: str, max_running: int, max_queue: int) -> tuple[Admit, int, int]:
        running, queued = self._counts.get(model, (0, 0))
        outcome, running, queued = _admit(running, queued, max_running, max_queue)
        self._counts[model] = (running, queued)
        return outcome, running, queued

    def claim(self, model: str, max_running: int) -> bool:
        running, queued = self._counts.get(model, (0, 0))
        if running >= max_running:
            return False
        self._counts[model] = (running + 1, queued - 1)
        return True

    def _add(self, model: str, running: int, queued: int) -> None:
        r, q = self._counts.get(model, (0, 0))
        self._counts[model] = (r + running, q + queued)


def _admit(running: int, queued: int, max_running: int, max_queue: int) -> tuple[Admit, int, int]:
    """The counts after a newcomer: (what it does, running, queued)."""
    if running < max_running and queued == 0:
        return Admit.RUN, running + 1, queued
    if queued < max_queue:
        return Admit.QUEUE, running, queued + 1
    return Admit.FULL, running, queued


class SharedLimits(_Moves):
    """The state in a file that every process of one service maps; this object is one
    process's view of it (`pid`: the process whose share it counts)."""

    poll_s: float | None = POLL_S

    def __init__(self, path: Path, pid: int | None = None) -> None:
        """Open a file that `create` made; OSError names it and says why not."""
        self.path = path
        self.pid = os.getpid() if pid is None else pid
        try:
            self._fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise OSError(f"cannot open the shared limits file {path}: {e.strerror}") from e
        try:
            size = os.fstat(self._fd).st_size
            if size != SIZE:
                raise OSError(
                    f"the shared limits file {path} is not one of this version "
                    f"({size} bytes, expected {SIZE})"
                )
            self._map = mmap.mmap(self._fd, SIZE)
        except BaseException:
            os.close(self._fd)
            raise
        try:
            if _HEADER.unpack_from(self._map, 0) != (_MAGIC, PROCESSES, MODELS, BUCKETS):
                raise OSError(f"the shared limits file {path} is not one of this version")
            self._models: dict[str, int] = {}  # name -> slot; a slot is never freed
            with self._locked():
                self._proc = self._claim_process()
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, directory: Path | None = None) -> SharedLimits:
        """A new file in a new private directory (under `directory`, else the system's
        temporary one), opened for this process."""
        where: Path | None = None
        try:
            where = Path(tempfile.mkdtemp(prefix="switchyard-limits-", dir=directory))
            path = where / "limits"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, SIZE)
                os.pwrite(fd, _HEADER.pack(_MAGIC, PROCESSES, MODELS, BUCKETS), 0)
            finally:
                os.close(fd)
        except OSError as e:
            if where is not None:
                shutil.rmtree(where, ignore_errors=True)
            raise OSError(
                "cannot create the file of limits shared by the router processes in "
                f"{directory or tempfile.gettempdir()}: {e.strerror or e}"
            ) from e
        return cls(path)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def remove(self) -> None:
        """Close, and delete the file and its directory (the supervisor, at the end)."""
        self.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
            self.path.parent.rmdir()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # Processes and their shares

    def _claim_process(self) -> int:
        free = None
        for i in range(PROCESSES):
            (pid,) = _PROC.unpack_from(self._map, _PROCS_AT + i * _PROC.size)
            if pid == self.pid:  # a process of this pid died unnoticed: its share goes
                self._reclaim_slot(i)
                free = i
                break
            if pid == 0 and free is None:
                free = i
        if free is None:
            raise OSError(
                f"the shared limits file {self.path} has room for {PROCESSES} processes, all taken"
            )
        _PROC.pack_into(self._map, _PROCS_AT + free * _PROC.size, self.pid)
        return free

    def reclaim(self, pid: int) -> dict[str, int]:
        """Give back what process `pid` held (it has exited) and free its place:
        {"running": slots it held, "queued": its waiters}, over all models."""
        with self._locked():
            for i in range(PROCESSES):
                if _PROC.unpack_from(self._map, _PROCS_AT + i * _PROC.size)[0] == pid:
                    return self._reclaim_slot(i)
        return {"running": 0, "queued": 0}

    def _reclaim_slot(self, proc: int) -> dict[str, int]:
        total_r = total_q = 0
        for m in range(MODELS):
            at = _SHARES_AT + (proc * MODELS + m) * _SHARE.size
            r, q = _SHARE.unpack_from(self._map, at)
            if r or q:
                key, running, queued = _MODEL.unpack_from(self._map, _MODELS_AT + m * _MODEL.size)
                _MODEL.pack_into(
                    self._map, _MODELS_AT + m * _MODEL.size, key, running - r, queued - q
                )
                _SHARE.pack_into(self._map, at, 0, 0)
                total_r, total_q = total_r + r, total_q + q
        _PROC.pack_into(self._map, _PROCS_AT + proc * _PROC.size, 0)
        return {"running": total_r, "queued": total_q}

    # Admission

    def _model(self, model: str) -> int:
        """The model's slot: found, or claimed (under the lock)."""
        slot = self._models.get(model)
        if slot is not None:
            return slot
        key = hashlib.sha256(model.encode()).digest()[:16]
        start = int.from_bytes(key[:8], "little") % MODELS
        for i in range(MODELS):
            slot = (start + i) % MODELS
            found = _MODEL.unpack_from(self._map, _MODELS_AT + slot * _MODEL.size)[0]
            if found == _FREE:
                _MODEL.pack_into(self._map, _MODELS_AT + slot * _MODEL.size, key, 0, 0)
            if found in (_FREE, key):
                self._models[model] = slot
                return slot
        raise RuntimeError(
            f"the shared limits file {self.path} has room for {MODELS} model names, all taken"
        )

    def counts(self, model: str) -> tuple[int, int]:
        """The service's (running, queued) for `model`."""
        with self._locked():
            _, running, queued = _MODEL.unpack_from(
                self._map, _MODELS_AT + self._model(model) * _MODEL.size
            )
            return running, queued

    def held(self, pid: int, model: str) -> tuple[int, int]:
        """What process `pid` holds of `model`: (running, queued)."""
        with self._locked():
            slot = self._model(model)
            for i in range(PROCESSES):
                if _PROC.unpack_from(self._map, _PROCS_AT + i * _PROC.size)[0] == pid:
                    at = _SHARES_AT + (i * MODELS + slot) * _SHARE.size
                    running, queued = _SHARE.unpack_from(self._map, at)
                    return running, queued
        return 0, 0

    def _change(self, slot: int, key: bytes, running: int, queued: int, dr: int, dq: int) -> None:
        """Write the model's new counts, and this process's share of the change."""
        _MODEL.pack_into(self._map, _MODELS_AT + slot * _MODEL.size, key, running, queued)
        at = _SHARES_AT + (self._proc * MODELS + slot) * _SHARE.size
        r, q = _SHARE.unpack_from(self._map, at)
        _SHARE.pack_into(self._map, at, r + dr, q + dq)

    def admit(self, model: str, max_running: int, max_queue: int) -> tuple[Admit, int, int]:
        with self._locked():
            slot = self._model(model)
            key, running, queued = _MODEL.unpack_from(self._map, _MODELS_AT + slot * _MODEL.size)
            outcome, new_r, new_q = _admit(running, queued, max_running, max_queue)
            if outcome is not Admit.FULL:
                self._change(slot, key, new_r, new_q, new_r - running, new_q - queued)
            return outcome, new_r, new_q

    def claim(self, model: str, max_running: int) -> bool:
        with self._locked():
            slot = self._model(model)
            key, running, queued = _MODEL.unpack_from(self._map, _MODELS_AT + slot * _MODEL.size)
            if running >= max_running:
                return False
            self._change(slot, key, running + 1, queued - 1, 1, -1)
            return True

    def _add(self, model: str, running: int, queued: int) -> None:
        with self._locked():
            slot = self._model(model)
            key, r, q = _MODEL.unpack_from(self._map, _MODELS_AT + slot * _MODEL.size)
            self._change(slot, key, r + running, q + queued, running, queued)

    # Token buckets

    def _probe(self, bucket: Bucket, now: float | None) -> int | None:
        """The bucket's slot (under the lock). Where it has none: None, or with `now`
        the slot it may take, on its probe chain: the first whose bucket has refilled
        completely since it was last used, else the free one that ends the chain."""
        start = int.from_bytes(bucket.key[:8], "little") % BUCKETS
        reusable = None
        for i in range(BUCKETS):
            slot = (start + i) % BUCKETS
            key, rate, capacity, level, updated = _BUCKET.unpack_from(
                self._map, _BUCKETS_AT + slot * _BUCKET.size
            )
            if key == bucket.key:
                return slot
            if key == _FREE:
                return None if now is None else slot if reusable is None else reusable
            if now is not None and reusable is None and level + (now - updated) * rate >= capacity:
                reusable = slot
        if now is not None and reusable is None:
            raise RuntimeError(
                f"the shared limits file {self.path} has room for {BUCKETS} token buckets, "
                "all in use"
            )
        return reusable

    def take(self, bucket: Bucket, n: float, floor: float, now: float) -> float | None:
        with self._locked():
            slot = self._probe(bucket, now)
            assert slot is not None
            at = _BUCKETS_AT + slot * _BUCKET.size
            key, _, _, level, updated = _BUCKET.unpack_from(self._map, at)
            if key != bucket.key:  # a new bucket: full
                level, updated = bucket.capacity, now
            level, updated = refill(level, updated, bucket, now)
            level, wait = _take(level, n, floor, bucket.rate)
            _BUCKET.pack_into(
                self._map, at, bucket.key, bucket.rate, bucket.capacity, level, updated
            )
            return wait

    def give_back(self, bucket: Bucket, n: float) -> None:
        with self._locked():
            slot = self._probe(bucket, None)
            if slot is None:  # not there: full
                return
            at = _BUCKETS_AT + slot * _BUCKET.size
            key, rate, capacity, level, updated = _BUCKET.unpack_from(self._map, at)
            _BUCKET.pack_into(self._map, at, key, rate, capacity, min(capacity, level + n), updated)
