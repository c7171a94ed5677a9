"""GPU memory in use on the GPUs an engine runs on, read through NVML.

vLLM carries its own copy of NVML's bindings (`vllm.third_party.pynvml`), so this needs
nothing more on a GPU machine; on a machine without NVIDIA's driver every reading is
zero. NVML numbers GPUs physically while the engine sees `CUDA_VISIBLE_DEVICES`; the
first `world_size` visible devices are the ones vLLM's ranks take on one machine.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class GpuMemory:
    used_bytes: int = 0
    total_bytes: int = 0


def _physical_indices(world_size: int) -> list[int | str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return list(range(world_size))
    ids: list[int | str] = []
    for part in visible.split(",")[:world_size]:
        part = part.strip()
        ids.append(int(part) if part.isdigit() else part)  # a UUID stays a string
    return ids


class GpuMemoryReader:
    """Reads NVML at most every `min_interval_s` (StreamLoad asks twice a second)."""

    def __init__(self, world_size: int, min_interval_s: float = 0.25) -> None:
        self._min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._last = GpuMemory()
        self._read_at = float("-inf")
        self._nvml: Any = None
        self._handles: list[Any] = []
        if world_size < 1:
            return  # an engine on no GPU (a test's fake)
        try:
            from vllm.third_party import pynvml

            pynvml.nvmlInit()
            for index in _physical_indices(world_size):
                if isinstance(index, int):
                    self._handles.append(pynvml.nvmlDeviceGetHandleByIndex(index))
                else:
                    self._handles.append(pynvml.nvmlDeviceGetHandleByUUID(index))
            self._nvml = pynvml
        except Exception as exc:  # no driver (a CPU machine), or an old one
            log.debug("no GPU memory readings", reason=str(exc) or type(exc).__name__)
            self._handles = []

    def read(self) -> GpuMemory:
        if self._nvml is None:
            return GpuMemory()
        now = time.monotonic()
        with self._lock:
            if now - self._read_at < self._min_interval_s:
                return self._last
            used = total = 0
            try:
                for handle in self._handles:
                    info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                    used += int(info.used)
                    total += int(info.total)
            except Exception:
                log.warning("GPU memory reading failed", exc_info=True)
                return self._last
            self._last = GpuMemory(used, total)
            self._read_at = now
            return self._last
