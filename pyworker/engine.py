"""Building the vLLM engine: `AsyncLLM` in-process, plus a stat logger that keeps load.

`build_engine()` must run before any gRPC server exists in this process: vLLM starts
its engine core in a child process, and gRPC does not survive a fork.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from pyworker.adapters import LoraLimits
from pyworker.beams import max_beam_width
from pyworker.cpu_binding import BIND_ENV, bind_cpu_ranks
from pyworker.engine_args import blame, current_machine, engine_arg_names, resolve
from pyworker.gpu_memory import GpuMemoryReader
from pyworker.kv_events import engine_kwargs
from pyworker.resume_grammar import BACKENDS, resumable, resume_backend
from pyworker.resume_grammar import PROCESSOR as RESUME_PROCESSOR
from pyworker.stderr_tail import StderrTail

log = structlog.get_logger(__name__)

DEFAULT_KVCACHE_SPACE_GIB = "1"


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
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    quantization: str = ""
    weight_dtype: str = ""
    kv_cache_dtype: str = ""
    max_batch_size: int = 0
    max_num_tokens: int = 0
    # The OutputConstraint kinds its structured-output backend takes (Capabilities).
    structured_output: tuple[str, ...] = ()
    lora: LoraLimits = field(default_factory=LoraLimits)  # the engine's LoRA settings
    max_beam_width: int = 0  # beam search (pyworker/beams.py); 0: none
    # The kinds whose streams it continues with the grammar advanced past another
    # worker's tokens (pyworker/resume_grammar.py); none where that is not loaded.
    resumable_constraints: tuple[str, ...] = ()


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


def make_stat_logger_factory(stats: LoadStats) -> Any:
    """The worker's stat logger for `AsyncLLM(stat_loggers=[...])`: it copies each
    `SchedulerStats` into `stats` (running, waiting, KV-cache use) and does nothing else.

    vLLM adds its own Prometheus logger unless a custom one is a `PrometheusStatLogger`;
    nothing scrapes that registry in the worker, and on a fast engine it cost about a
    seventh of the worker's CPU (histograms observed per request per step, see
    docs/results/profiles.md). So this one is a `PrometheusStatLogger` that registers no metrics:
    every method it does not define is a no-op.
    """
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class LoadStatLogger(PrometheusStatLogger):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            self.vllm_config = vllm_config
            self.engine_indexes = engine_indexes or [0]

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

    def _nothing(self: Any, *args: Any, **kwargs: Any) -> None:
        return None

    for name in dir(PrometheusStatLogger):
        if not name.startswith("_") and name not in ("record",):
            if callable(getattr(PrometheusStatLogger, name, None)):
                setattr(LoadStatLogger, name, _nothing)
    return LoadStatLogger


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
    gpu: GpuMemoryReader = field(default_factory=lambda: GpuMemoryReader(world_size=0))
    kv_events_endpoint: str | None = None  # where its engine core publishes KV-cache events

    def shutdown(self) -> None:
        try:
            self.llm.shutdown()
        except Exception:
            log.exception("engine shutdown failed")

    @property
    def errored(self) -> bool:
        return bool(getattr(self.llm, "errored", False))

    @property
    def traces(self) -> bool:
        """Whether the engine exports spans (vLLM's `otlp_traces_endpoint`): only then
        is a request's trace context worth handing it (vLLM warns and drops it else)."""
        config = getattr(getattr(self.llm, "vllm_config", None), "observability_config", None)
        return bool(getattr(config, "otlp_traces_endpoint", None))

    def trace_headers(self, headers: Mapping[str, str] | None) -> Mapping[str, str] | None:
        return headers if headers and self.traces else None


def prepare_environment(engine_args: Mapping[str, Any] | None = None) -> None:
    """Set vLLM's environment defaults, then import vLLM.

    Call it early, from a frame that will never hold the engine: some of vLLM's
    import-time frames stay alive, and through `f_back` so do their callers' locals. An
    AsyncLLM kept alive that way is only collected at interpreter exit, where its
    `__del__` fails.
    """
    if "kv_cache_memory_bytes" not in (engine_args or {}):
        # vLLM-CPU's KV cache size; it overrides kv_cache_memory_bytes when set.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_SPACE_GIB)
    # gRPC is imported in this process; never fork it into the engine core.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import vllm.engine.arg_utils
    import vllm.v1.engine.async_llm
    import vllm.v1.metrics.loggers  # noqa: F401


def build_engine(
    model: str, engine_args: Mapping[str, Any], tail: StderrTail | None = None
) -> Engine:
    """Check `engine_args` and build the AsyncLLM (blocks until the engine core is ready).

    Raises EngineArgsError, naming the setting, for what the checks, vLLM's config or
    its engine start refuse; `tail` is where the engine core's own last words are read.
    """
    prepare_environment(engine_args)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    names = engine_arg_names()
    machine = current_machine()
    kwargs, kv_events = engine_kwargs(resolve(engine_args, model, machine, names))
    if machine.platform == "cpu":
        ranks = int(kwargs.get("tensor_parallel_size") or 1) * int(
            kwargs.get("pipeline_parallel_size") or 1
        )
        binding = bind_cpu_ranks(ranks)
        if binding is not None:
            log.info("CPU ranks bound", ranks=ranks, **{BIND_ENV: binding})
    if resumable(kwargs):
        # Constrained streams resumed here continue their grammar (resume_grammar.py).
        processors = list(kwargs.get("logits_processors") or ())
        kwargs["logits_processors"] = [*processors, RESUME_PROCESSOR]
    log.info("checking engine settings", model=model, engine_args=kwargs)
    try:
        vllm_config = AsyncEngineArgs(**kwargs).create_engine_config()
    except Exception as exc:
        named = blame(exc, engine_args, names)
        if named is None:
            raise
        raise named from exc

    load = LoadStats()
    started = time.monotonic()
    log.info("loading engine", model=model)
    try:
        llm = AsyncLLM.from_vllm_config(
            vllm_config, stat_loggers=[make_stat_logger_factory(load)], disable_log_stats=True
        )
    except Exception as exc:
        said = tail.engine_failure() if tail is not None else None
        named = blame(RuntimeError(said), engine_args, names) if said else None
        if named is None:
            raise
        raise named from exc
    info = engine_info(llm, model)
    batched = int(getattr(llm.vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
    if 0 < batched < info.max_context and machine.platform == "cpu":
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
        tensor_parallel_size=info.tensor_parallel_size,
        pipeline_parallel_size=info.pipeline_parallel_size,
        quantization=info.quantization or None,
        kv_cache_dtype=info.kv_cache_dtype,
    )
    world = info.tensor_parallel_size * info.pipeline_parallel_size
    return Engine(
        llm=llm, load=load, info=info, gpu=GpuMemoryReader(world), kv_events_endpoint=kv_events
    )


def engine_info(llm: Any, model: str) -> EngineInfo:
    import vllm

    vllm_config = llm.vllm_config
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    scheduler_config = vllm_config.scheduler_config
    parallel_config = vllm_config.parallel_config
    weight_dtype = str(model_config.dtype).removeprefix("torch.")
    kv_dtype = str(cache_config.cache_dtype)
    max_logprobs = int(getattr(model_config, "max_logprobs", 20))
    return EngineInfo(
        engine="vllm",
        engine_version=str(getattr(vllm, "__version__", "unknown")),
        model=model,
        max_context=int(model_config.max_model_len),
        vocab_size=int(model_config.get_vocab_size()),
        eos_token_ids=_eos_token_ids(llm, model_config),
        kv_block_size=int(cache_config.block_size or 0),
        kv_blocks_total=int(getattr(cache_config, "num_gpu_blocks", 0) or 0),
        max_logprobs=max_logprobs,
        priority_scheduling=str(getattr(scheduler_config, "policy", "fcfs")) == "priority",
        tensor_parallel_size=int(parallel_config.tensor_parallel_size),
        pipeline_parallel_size=int(parallel_config.pipeline_parallel_size),
        quantization=str(model_config.quantization or ""),
        weight_dtype=weight_dtype,
        kv_cache_dtype=weight_dtype if kv_dtype == "auto" else kv_dtype,
        max_batch_size=int(getattr(scheduler_config, "max_num_seqs", 0) or 0),
        max_num_tokens=int(getattr(scheduler_config, "max_num_batched_tokens", 0) or 0),
        structured_output=_structured_output_kinds(vllm_config),
        lora=LoraLimits.of(getattr(vllm_config, "lora_config", None)),
        max_beam_width=max_beam_width(max_logprobs, not model_config.skip_tokenizer_init),
        resumable_constraints=_resumable_kinds(vllm_config),
    )


# vLLM's structured outputs (xgrammar, guidance or outlines, "auto" picks) take every kind
# of OutputConstraint: a JSON schema, any JSON object, a regex, choices, a grammar.
STRUCTURED_OUTPUT_KINDS = ("choice", "grammar", "json_object", "json_schema", "regex")


def _structured_output_kinds(vllm_config: Any) -> tuple[str, ...]:
    """None without a tokenizer (`skip_tokenizer_init`): the backends compile the
    constraint against the vocabulary."""
    config = getattr(vllm_config, "structured_outputs_config", None) or getattr(
        vllm_config, "decoding_config", None
    )
    if config is None or vllm_config.model_config.skip_tokenizer_init:
        return ()
    return STRUCTURED_OUTPUT_KINDS


def _resumable_kinds(vllm_config: Any) -> tuple[str, ...]:
    """The structured-output kinds it takes, where the resume processor is loaded and
    drives the engine's backend."""
    processors = getattr(vllm_config.model_config, "logits_processors", None) or ()
    if RESUME_PROCESSOR not in processors or resume_backend(vllm_config) not in BACKENDS:
        return ()
    return _structured_output_kinds(vllm_config)


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
