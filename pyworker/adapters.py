"""The LoRA adapters a vLLM worker holds: loaded at run time (LoadAdapter), named by
requests, and unloaded once the requests using them are done (UnloadAdapter).

vLLM takes an adapter as a `LoRARequest` (name, an id unique in the engine, the path of
a PEFT adapter directory) on each request, and loads it on first use; `add_lora` loads
it ahead, so that a bad adapter fails its LoadAdapter, not a request. This module keeps
the names the worker has been told to hold, the requests using each, and refuses any
other name, so that an unloaded adapter is never loaded again by a late request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pyworker.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Overloaded,
)
from switchyard_common.names import ADAPTER_NAME, ADAPTER_NAME_RULE

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class LoraLimits:
    """The engine's LoRA settings (vLLM's LoRAConfig); `enabled` False without one."""

    enabled: bool = False
    max_loras: int = 0  # adapters in one batch
    max_lora_rank: int = 0
    max_cpu_loras: int = 0  # adapters held at once

    @classmethod
    def of(cls, lora_config: Any) -> LoraLimits:
        if lora_config is None:
            return cls()
        max_loras = int(lora_config.max_loras)
        return cls(
            enabled=True,
            max_loras=max_loras,
            max_lora_rank=int(lora_config.max_lora_rank),
            max_cpu_loras=int(getattr(lora_config, "max_cpu_loras", None) or max_loras),
        )


@dataclass(slots=True)
class Adapter:
    name: str
    path: str
    rank: int
    lora_id: int
    request: Any  # vllm.lora.request.LoRARequest
    in_flight: set[str] = field(default_factory=set)  # engine request ids using it
    unloading: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)


def read_rank(path: str) -> int:
    """The rank `r` of a PEFT adapter directory; InvalidArgument naming `path`."""
    config = Path(path) / "adapter_config.json"
    if not Path(path).is_dir():
        raise InvalidArgument.for_field("path", f"{path!r} is not a directory on this worker")
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        raise InvalidArgument.for_field("path", f"{path!r} has no adapter_config.json") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgument.for_field("path", f"{config} is not readable JSON: {exc}") from exc
    rank = data.get("r") if isinstance(data, dict) else None
    if not isinstance(rank, int) or rank < 1:
        raise InvalidArgument.for_field("path", f"{config} has no positive integer rank 'r'")
    return rank


class Adapters:
    """Name -> Adapter, and which requests use which."""

    def __init__(self, limits: LoraLimits) -> None:
        self.limits = limits
        self._by_name: dict[str, Adapter] = {}
        self._loading: set[str] = set()
        self._next_id = 1

    @contextlib.contextmanager
    def loading(self, name: str) -> Iterator[None]:
        """While the engine loads `name`: a second LoadAdapter of it is refused."""
        self._loading.add(name)
        try:
            yield
        finally:
            self._loading.discard(name)

    def all(self) -> list[Adapter]:
        return list(self._by_name.values())

    def check_load(self, name: str, path: str) -> Adapter | None:
        """Validate a LoadAdapter; the adapter already held under that name and path, if
        any (then there is nothing to do)."""
        if not self.limits.enabled:
            raise FailedPrecondition(
                "this engine was started without LoRA (engine_args enable_lora: true, "
                "with max_loras and max_lora_rank)"
            )
        if not ADAPTER_NAME.fullmatch(name):
            raise InvalidArgument.for_field("name", ADAPTER_NAME_RULE)
        if name in self._loading:
            raise AlreadyExists(f"adapter {name!r} is being loaded")
        held = self._by_name.get(name)
        if held is not None:
            if held.path == path and not held.unloading:
                return held
            state = "being unloaded" if held.unloading else f"loaded from {held.path!r}"
            raise AlreadyExists(f"adapter {name!r} is already {state}")
        rank = read_rank(path)
        if rank > self.limits.max_lora_rank:
            raise InvalidArgument.for_field(
                "path",
                f"adapter rank {rank} exceeds the engine's max_lora_rank "
                f"{self.limits.max_lora_rank}",
            )
        if len(self._by_name) + len(self._loading) >= self.limits.max_cpu_loras:
            raise Overloaded(
                f"this engine holds at most {self.limits.max_cpu_loras} adapters "
                "(engine_args max_cpu_loras, default max_loras); unload one first"
            )
        return None

    def new_request(self, name: str, path: str) -> tuple[Any, int]:
        from vllm.lora.request import LoRARequest

        lora_id = self._next_id
        self._next_id += 1
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path), lora_id

    def add(self, name: str, path: str, request: Any, lora_id: int) -> Adapter:
        adapter = Adapter(name, path, read_rank(path), lora_id, request)
        adapter.idle.set()
        self._by_name[name] = adapter
        log.info("adapter loaded", adapter=name, path=path, rank=adapter.rank, lora_id=lora_id)
        return adapter

    def acquire(self, name: str, request_id: str) -> Any:
        """The LoRARequest of a request naming `name`, counted in use; NotFound."""
        if not self.limits.enabled:
            raise FailedPrecondition("this engine was started without LoRA; it holds no adapters")
        adapter = self._by_name.get(name)
        if adapter is None or adapter.unloading:
            held = ", ".join(sorted(a.name for a in self.all() if not a.unloading)) or "none"
            why = "is being unloaded" if adapter else "is not loaded"
            raise NotFound.for_field("adapter", f"adapter {name!r} {why} (loaded: {held})")
        adapter.in_flight.add(request_id)
        adapter.idle.clear()
        return adapter.request

    def release(self, name: str, request_id: str) -> None:
        adapter = self._by_name.get(name)
        if adapter is not None:
            adapter.in_flight.discard(request_id)
            if not adapter.in_flight:
                adapter.idle.set()

    def begin_unload(self, name: str) -> Adapter:
        if not self.limits.enabled:
            raise FailedPrecondition("this engine was started without LoRA; it holds no adapters")
        adapter = self._by_name.get(name)
        if adapter is None or adapter.unloading:
            raise NotFound.for_field("name", f"adapter {name!r} is not loaded")
        adapter.unloading = True
        return adapter

    def remove(self, adapter: Adapter) -> None:
        if self._by_name.get(adapter.name) is adapter:
            del self._by_name[adapter.name]
        log.info("adapter unloaded", adapter=adapter.name, lora_id=adapter.lora_id)
