"""Building the vLLM engine: `AsyncLLM` in-process, plus a stat logger that keeps load.

`build_engine()` must run before any gRPC server exists in this process: vLLM starts
its engine core in a child process, and gRPC does not survive a fork.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# vLLM-CPU: a seeded request whose prompt is split across prefill steps kills the
# engine ("CPU Generator does not use offset"), so no prompt may ever be split.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 16384
DEFAULT_KVCACHE_SPACE_GIB = "1"


@dataclass(frozen=True)
class EngineSettings:
    """What the worker needs to build one engine for one model."""

    model: str
    max_model_len: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    dtype: str = "auto"
    max_num_seqs: int | None = None
    seed: int | None = None
    enforce_eager: bool = False


@dataclass(frozen=True)
class EngineInfo:
    """Static facts about the loaded engine, answered by GetInfo."""

    engine: str
    engine_version: str
    model: str
    max_context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_block_size: int
    kv_blocks_total: int
    max_logprobs: int
    priority_scheduling: bool


@dataclass
class SchedulerSnapshot:
    """The latest scheduler numbers the engine reported."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    updated_at: float = 0.0  # time.monotonic() of the report; 0 before the first one


@dataclass
class LoadStats:
    """Shared between the stat logger (writer) and StreamLoad (reader).

    vLLM calls stat loggers from its output handler task on the event loop, but a
    lock keeps this correct should a release ever call them from another thread.
    """

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _snapshot: SchedulerSnapshot = field(default_factory=SchedulerSnapshot)

    def update(self, running: int, waiting: int, kv_cache_usage: float) -> None:
        snap = SchedulerSnapshot(running, waiting, kv_cache_usage, time.monotonic())
        with self._lock:
            self._snapshot = snap

    def snapshot(self) -> SchedulerSnapshot:
        with self._lock:
            return self._snapshot


def _stat_logger_base() -> type[Any]:
    from vllm.v1.metrics.loggers import StatLoggerBase

    base: type[Any] = StatLoggerBase
    return base


def make_stat_logger_factory(stats: LoadStats) -> Any:
    """A per-engine stat logger factory for `AsyncLLM(stat_loggers=[...])`.

    vLLM calls `factory(vllm_config, engine_index)`; the logger it returns copies each
    `SchedulerStats` into `stats`. The base class's signature is not stable across
    releases, so everything beyond `record` is accepted loosely.
    """
    base = _stat_logger_base()

    class LoadStatLogger(base):  # type: ignore[misc,valid-type]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            if scheduler_stats is None:
                return
            stats.update(
                running=int(getattr(scheduler_stats, "num_running_reqs", 0)),
                waiting=int(getattr(scheduler_stats, "num_waiting_reqs", 0)),
                kv_cache_usage=float(getattr(scheduler_stats, "kv_cache_usage", 0.0)),
            )

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    def factory(vllm_config: Any, engine_index: int = 0) -> Any:
        return LoadStatLogger(vllm_config, engine_index)

    return factory


TokenPromptFactory = Callable[[list[int]], Any]


def token_prompt_factory() -> TokenPromptFactory:
    """How this vLLM release wants a prompt of token ids passed to `generate()`.

    Releases with `vllm.inputs.engine.tokens_input` take an already rendered input and
    deprecate raw prompts; older ones take a `TokensPrompt`.
    """
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        def legacy(prompt_token_ids: list[int]) -> Any:
            return TokensPrompt(prompt_token_ids=prompt_token_ids)

        return legacy
    factory: TokenPromptFactory = tokens_input
    return factory


@dataclass
class Engine:
    """A built engine: the AsyncLLM, its load stats and its static facts."""

    llm: Any  # vllm.v1.engine.async_llm.AsyncLLM
    load: LoadStats
    info: EngineInfo
    make_prompt: TokenPromptFactory = field(default_factory=token_prompt_factory)

    def shutdown(self) -> None:
        try:
            self.llm.shutdown()
        except Exception:
            log.exception("engine shutdown failed")

    @property
    def errored(self) -> bool:
        return bool(getattr(self.llm, "errored", False))


def prepare_environment() -> None:
    """Set vLLM's environment defaults, then import vLLM.

    Call it early, from a frame that will never hold the engine: some of vLLM's
    import-time frames stay alive, and through `f_back` so do their callers' locals. An
    AsyncLLM kept alive that way is only collected at interpreter exit, where its
    `__del__` fails.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_SPACE_GIB)
    # gRPC is imported in this process; never fork it into the engine core.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm
    import vllm.v1.metrics.loggers  # noqa: F401


def build_engine(settings: EngineSettings) -> Engine:
    """Build the AsyncLLM (blocks until the engine core is ready)."""
    prepare_environment()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs: dict[str, Any] = {
        "model": settings.model,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "dtype": settings.dtype,
        "enforce_eager": settings.enforce_eager,
        # The default logging stat logger only prints; our own logger keeps load.
        "disable_log_stats": True,
    }
    if settings.max_model_len is not None:
        kwargs["max_model_len"] = settings.max_model_len
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if settings.seed is not None:
        kwargs["seed"] = settings.seed
    args = AsyncEngineArgs(**kwargs)

    load = LoadStats()
    started = time.monotonic()
    log.info("loading engine", model=settings.model, engine_args=kwargs)
    llm = AsyncLLM.from_engine_args(args, stat_loggers=[make_stat_logger_factory(load)])
    info = engine_info(llm, settings.model)
    batched = int(getattr(llm.vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
    if 0 < batched < info.max_context:
        log.warning(
            "prompts longer than max_num_batched_tokens are split across prefill steps; "
            "on vLLM-CPU a seeded request split that way kills the engine",
            max_num_batched_tokens=batched,
            max_context=info.max_context,
        )
    log.info(
        "engine ready",
        seconds=round(time.monotonic() - started, 1),
        max_context=info.max_context,
        vocab_size=info.vocab_size,
        eos_token_ids=list(info.eos_token_ids),
        kv_blocks=info.kv_blocks_total,
    )
    return Engine(llm=llm, load=load, info=info)


def engine_info(llm: Any, model: str) -> EngineInfo:
    import vllm

    vllm_config = llm.vllm_config
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    scheduler_config = vllm_config.scheduler_config
    return EngineInfo(
        engine="vllm",
        engine_version=str(getattr(vllm, "__version__", "unknown")),
        model=model,
        max_context=int(model_config.max_model_len),
        vocab_size=int(model_config.get_vocab_size()),
        eos_token_ids=_eos_token_ids(llm, model_config),
        kv_block_size=int(cache_config.block_size or 0),
        kv_blocks_total=int(getattr(cache_config, "num_gpu_blocks", 0) or 0),
        max_logprobs=int(getattr(model_config, "max_logprobs", 20)),
        priority_scheduling=str(getattr(scheduler_config, "policy", "fcfs")) == "priority",
    )


def _eos_token_ids(llm: Any, model_config: Any) -> tuple[int, ...]:
    """EOS ids from the generation config, the HF config and the tokenizer, in order."""
    found: list[int] = []

    def add(value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool):
            if value >= 0 and value not in found:
                found.append(value)
        elif isinstance(value, list | tuple):
            for item in value:
                add(item)

    try:
        add(model_config.try_get_generation_config().get("eos_token_id"))
    except Exception:
        log.warning("no generation config", exc_info=True)
    add(getattr(model_config.hf_config, "eos_token_id", None))
    if not found:
        tokenizer = getattr(llm, "tokenizer", None)
        add(getattr(tokenizer, "eos_token_id", None))
    return tuple(found)
