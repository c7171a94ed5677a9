"""vLLM engine settings: the operator's `engine_args`, checked before minutes of engine start.

The names are vLLM's own: whatever fields the installed release's `AsyncEngineArgs` has
(vLLM 0.26 on GPUs, 0.32 on CPUs, and the releases after), never a list kept here. On top
of vLLM's own checks, the deployment mistakes that otherwise cost an engine start (or a
crash minutes into one) are caught here from the model's `config.json` and the machine:
a parallel size above the GPUs visible or one that does not divide the attention heads,
`gpu_memory_utilization` outside (0, 1], a `quantization` the checkpoint does not carry
and cannot be applied at load, or one the GPU cannot run. What vLLM itself refuses,
while building its config or while its engine starts, is named the same way by `blame`.

Every failure is an `EngineArgsError` that names the setting and the reason.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# vLLM-CPU: a seeded request whose prompt is split across prefill steps kills the
# engine ("CPU Generator does not use offset"), so on the CPU no prompt is split.
CPU_MAX_NUM_BATCHED_TOKENS = 16384

# Set by Switchyard itself; an operator who sets them would break the worker.
RESERVED = {
    "model": "the worker serves the model's own directory; set models[].model instead",
    "disable_log_stats": "the worker's load reports come from the engine's stats",
}

# Quantization methods that quantize an unquantized checkpoint while it loads; every
# other method needs a checkpoint quantized with it (config.json quantization_config).
QUANTIZE_AT_LOAD = frozenset(
    {"fp8", "ptpc_fp8", "experts_int8", "bitsandbytes", "torchao", "online", "inc"}
)


class EngineArgsError(ValueError):
    """A setting the engine cannot start with: which one(s), and why."""

    def __init__(self, keys: str | Sequence[str], reason: str) -> None:
        self.keys = (keys,) if isinstance(keys, str) else tuple(keys)
        self.reason = reason
        where = " / ".join(f"engine_args.{k}" for k in self.keys) or "engine"
        super().__init__(f"{where}: {reason}")


@dataclass(frozen=True)
class Machine:
    """What the checks need to know about where the engine runs."""

    platform: str  # "cuda", "rocm", "cpu", ...
    gpus_visible: int
    capability: int | None = None  # e.g. 90 for an H200; None off GPUs


@dataclass(frozen=True)
class ModelFacts:
    """What the checks read from the model's config.json (None where it says nothing)."""

    max_position_embeddings: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    num_hidden_layers: int | None = None
    quant_method: str | None = None
    found: bool = False  # config.json was read (not a hub name, say)

    @classmethod
    def read(cls, model: str) -> ModelFacts:
        path = Path(model) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()  # a hub name or no config: vLLM's own checks still apply
        if not isinstance(raw, dict):
            return cls()
        text = raw.get("text_config")
        cfg = {**raw, **text} if isinstance(text, dict) else raw
        quant = raw.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else None

        def num(key: str) -> int | None:
            v = cfg.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        return cls(
            max_position_embeddings=num("max_position_embeddings"),
            num_attention_heads=num("num_attention_heads"),
            num_key_value_heads=num("num_key_value_heads"),
            num_hidden_layers=num("num_hidden_layers"),
            quant_method=str(method).lower() if method else None,
            found=True,
        )


class EngineArgSchema(Collection[str]):
    """The installed vLLM's engine arguments: their names, and their types as
    `AsyncEngineArgs` declares them (checked with pydantic, which vLLM's configs use)."""

    def __init__(self, types: Mapping[str, Any]) -> None:
        self._types = dict(types)
        self._adapters: dict[str, Any] = {}

    @classmethod
    def installed(cls) -> EngineArgSchema:
        import dataclasses
        import sys

        from vllm.engine.arg_utils import AsyncEngineArgs

        types: dict[str, Any] = {}
        for f in dataclasses.fields(AsyncEngineArgs):
            hint: Any = f.type
            if isinstance(hint, str):  # postponed annotations: evaluate in their module
                owner = next(
                    c
                    for c in AsyncEngineArgs.__mro__
                    if f.name in vars(c).get("__annotations__", {})
                )
                try:
                    hint = eval(hint, vars(sys.modules[owner.__module__]))
                except Exception:
                    hint = None  # a name the module imports only for type checkers
            types[f.name] = hint
        return cls(types)

    def __contains__(self, key: object) -> bool:
        return key in self._types

    def __iter__(self) -> Iterator[str]:
        return iter(self._types)

    def __len__(self) -> int:
        return len(self._types)

    def type_error(self, key: str, value: Any) -> str | None:
        """Why `value` is not of the declared type of `key` (None when it is, or when
        the type cannot be checked here). Mappings for vLLM's nested configs (such as
        compilation_config) are converted by vLLM itself, so they are checked loosely."""
        if value is None or key not in self._types or self._types[key] is None:
            return None
        import pydantic

        adapter = self._adapters.get(key)
        if adapter is None:
            try:
                adapter = pydantic.TypeAdapter(self._types[key])
            except Exception:
                self._types[key] = None
                return None
            self._adapters[key] = adapter
        try:
            if isinstance(value, dict):  # a nested config: vLLM converts it itself
                adapter.validate_python(value)
            else:  # as JSON, strictly: enums take their values, but "0.9" is no float
                adapter.validate_json(json.dumps(value), strict=True)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            return f"{first['msg']}, got {value!r}"
        return None


def engine_arg_names() -> EngineArgSchema:
    """The installed vLLM's engine arguments."""
    return EngineArgSchema.installed()


def check_names(raw: Mapping[str, Any], names: Collection[str]) -> None:
    """Every key is one of vLLM's engine arguments (or a known old name), of its type,
    and none is one Switchyard sets itself."""
    for key, value in raw.items():
        if key in RESERVED:
            raise EngineArgsError(key, f"set by Switchyard: {RESERVED[key]}")
        if key in _TRANSLATIONS:
            continue
        if key not in names:
            near = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise EngineArgsError(key, f"not an engine argument of vLLM {_vllm_version()}{hint}")
        if isinstance(names, EngineArgSchema) and (why := names.type_error(key, value)):
            raise EngineArgsError(key, why)


def _translate_swap_space(args: dict[str, Any], names: Collection[str], machine: Machine) -> None:
    """`swap_space` (GiB of CPU memory per GPU for preempted requests) is gone since vLLM's
    V1 engine, which recomputes preempted requests instead of swapping them. The memory
    it meant goes to KV-cache offloading to the CPU, its successor, as a total. On the
    CPU the KV cache is in CPU memory already (and vLLM-CPU offloads nothing)."""
    gib = args.pop("swap_space")
    if not isinstance(gib, int | float) or isinstance(gib, bool) or gib < 0:
        raise EngineArgsError("swap_space", f"expected GiB as a number >= 0, got {gib!r}")
    if "kv_offloading_size" not in names:
        raise EngineArgsError(
            "swap_space", f"vLLM {_vllm_version()} has neither swap space nor KV offloading"
        )
    if "kv_offloading_size" in args:
        raise EngineArgsError(
            ("swap_space", "kv_offloading_size"), "set one of them, not both (they are the same)"
        )
    if gib == 0:
        return
    if machine.platform == "cpu":
        log.warning(
            "swap_space ignored: on the CPU the KV cache is in CPU memory already "
            "(VLLM_CPU_KVCACHE_SPACE or kv_cache_memory_bytes sizes it)",
            swap_space_gib=gib,
        )
        return
    ranks = int(args.get("tensor_parallel_size", 1) or 1)
    ranks *= int(args.get("pipeline_parallel_size", 1) or 1)
    args["kv_offloading_size"] = float(gib) * ranks
    log.warning(
        "swap_space: vLLM's V1 engine does not swap; the memory goes to KV-cache offloading "
        "to the CPU instead",
        swap_space_gib=gib,
        kv_offloading_size_gib=args["kv_offloading_size"],
    )


_TRANSLATIONS = {"swap_space": _translate_swap_space}


def resolve(
    raw: Mapping[str, Any],
    model: str,
    machine: Machine,
    names: Collection[str],
    facts: ModelFacts | None = None,
) -> dict[str, Any]:
    """The keyword arguments for `AsyncEngineArgs`, or an EngineArgsError."""
    check_names(raw, names)
    args = dict(raw)
    for key, translate in _TRANSLATIONS.items():
        if key in args:
            translate(args, names, machine)
    facts = ModelFacts.read(model) if facts is None else facts
    _check_memory(args)
    _check_parallel(args, machine, facts)
    _check_quantization(args, machine, facts)
    if machine.platform == "cpu" and "max_num_batched_tokens" not in args:
        args["max_num_batched_tokens"] = CPU_MAX_NUM_BATCHED_TOKENS
    return {"model": model, **args, "disable_log_stats": True}


def _positive_int(args: Mapping[str, Any], key: str) -> int:
    v = args.get(key, 1)
    if v is None:
        return 1
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise EngineArgsError(key, f"expected a positive integer, got {v!r}")
    return v


def _check_memory(args: Mapping[str, Any]) -> None:
    if "gpu_memory_utilization" in args:
        v = args["gpu_memory_utilization"]
        if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v <= 1:
            raise EngineArgsError(
                "gpu_memory_utilization",
                f"expected a fraction of the GPU's memory in (0, 1], got {v!r}",
            )
    for key in ("cpu_offload_gb", "kv_offloading_size"):
        v = args.get(key)
        if v is not None and (not isinstance(v, int | float) or isinstance(v, bool) or v < 0):
            raise EngineArgsError(key, f"expected GiB as a number >= 0, got {v!r}")


def _check_parallel(args: Mapping[str, Any], machine: Machine, facts: ModelFacts) -> None:
    tp = _positive_int(args, "tensor_parallel_size")
    pp = _positive_int(args, "pipeline_parallel_size")
    heads, kv_heads = facts.num_attention_heads, facts.num_key_value_heads
    if heads is not None and heads % tp:
        raise EngineArgsError(
            "tensor_parallel_size",
            f"{tp} does not divide the model's {heads} attention heads (config.json "
            f"num_attention_heads); use one of {_divisors(heads)}",
        )
    if kv_heads is not None and tp > kv_heads and tp % kv_heads:
        raise EngineArgsError(
            "tensor_parallel_size",
            f"{tp} is neither a divisor nor a multiple of the model's {kv_heads} KV heads "
            "(config.json num_key_value_heads)",
        )
    layers = facts.num_hidden_layers
    if layers is not None and pp > layers:
        raise EngineArgsError(
            "pipeline_parallel_size",
            f"{pp} stages for a model of {layers} layers (config.json num_hidden_layers)",
        )
    backend = args.get("distributed_executor_backend")
    if backend not in (None, "mp", "uni", "ray", "external_launcher"):
        return  # a class or a new backend: vLLM checks it
    world = tp * pp
    # On Ray, the GPUs of the whole cluster count; vLLM checks those when it places ranks.
    if machine.platform in ("cuda", "rocm") and backend != "ray" and world > machine.gpus_visible:
        raise EngineArgsError(
            ("tensor_parallel_size", "pipeline_parallel_size"),
            f"tensor_parallel_size x pipeline_parallel_size = {world} GPUs, but "
            f"{machine.gpus_visible} are visible (CUDA_VISIBLE_DEVICES); for more GPUs than "
            "one machine has, use distributed_executor_backend: ray on a Ray cluster",
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_quantization(args: Mapping[str, Any], machine: Machine, facts: ModelFacts) -> None:
    method = args.get("quantization")
    if method is None:
        return
    if not isinstance(method, str):
        raise EngineArgsError("quantization", f"expected a method name, got {method!r}")
    known = _quantization_methods()
    if known and method not in known:
        near = difflib.get_close_matches(method, known, n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise EngineArgsError(
            "quantization", f"{method!r} is not a quantization method of this vLLM{hint}"
        )
    if facts.found and facts.quant_method is None and method not in _quantize_at_load():
        raise EngineArgsError(
            "quantization",
            f"{method!r} needs a checkpoint quantized with it, and the model's config.json "
            "has no quantization_config; methods that quantize while loading: "
            + ", ".join(sorted(_quantize_at_load() & set(known or QUANTIZE_AT_LOAD))),
        )
    if machine.capability is not None:
        need = _min_capability(method)
        if need is not None and machine.capability < need:
            raise EngineArgsError(
                "quantization",
                f"{method!r} needs a GPU of compute capability {need / 10:.1f} or newer; "
                f"this one is {machine.capability / 10:.1f}",
            )


def _quantization_methods() -> list[str]:
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except ImportError:
        return []
    return list(QUANTIZATION_METHODS)


def _quantize_at_load() -> frozenset[str]:
    try:
        from vllm.config.quantization import _ONLINE_SHORTHANDS
    except ImportError:
        return QUANTIZE_AT_LOAD
    return QUANTIZE_AT_LOAD | frozenset(_ONLINE_SHORTHANDS)


def _min_capability(method: str) -> int | None:
    try:
        from vllm.model_executor.layers.quantization import get_quantization_config

        need = get_quantization_config(method).get_min_capability()
    except Exception:  # a method that cannot say (or needs its own package): vLLM decides
        return None
    return int(need) if isinstance(need, int) else None


def current_machine() -> Machine:
    """The platform vLLM detected, with the GPUs this process can see."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        import torch

        cap = current_platform.get_device_capability()
        platform = "rocm" if current_platform.is_rocm() else "cuda"
        capability = cap.to_int() if cap is not None else None
        return Machine(platform, torch.cuda.device_count(), capability)
    return Machine("cpu" if current_platform.is_cpu() else "other", 0)


def _vllm_version() -> str:
    try:
        import vllm
    except ImportError:
        return "(not installed)"
    return str(getattr(vllm, "__version__", "?"))


# What vLLM says, and the settings that decide it. The first match wins.
_BLAME: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (re.compile(p, re.IGNORECASE), keys)
    for p, keys in (
        (
            r"to serve at least one request|no available memory for the cache blocks"
            r"|insufficient memory for kv cache",
            ("gpu_memory_utilization", "max_model_len"),
        ),
        (r"free memory on device .* is less than desired", ("gpu_memory_utilization",)),
        (r"max_model_len|max seq len|max_position_embeddings", ("max_model_len",)),
        # vLLM-CPU's own binding of ranks to NUMA nodes (an operator's "auto"; the worker
        # binds them itself otherwise, pyworker/cpu_binding.py)
        (
            r"NUMA nodes to bind threads|doesn't match local world size",
            ("tensor_parallel_size", "pipeline_parallel_size"),
        ),
        (r"attention heads|tensor.parallel", ("tensor_parallel_size",)),
        (r"pipeline.parallel|pipeline stages", ("pipeline_parallel_size",)),
        (r"kv.cache.dtype|kv_cache_dtype", ("kv_cache_dtype",)),
        (r"quantiz", ("quantization",)),
        (r"kv.?offload|offloading connector|cpu offloading is", ("kv_offloading_size",)),
        (r"cpu_offload|offload", ("cpu_offload_gb",)),
        (r"max_num_batched_tokens", ("max_num_batched_tokens",)),
        (r"max_num_seqs", ("max_num_seqs",)),
        (r"out of memory", ("gpu_memory_utilization",)),
    )
)


_SIZES_KV_CACHE = {
    "gpu_memory_utilization",
    "max_model_len",
    "kv_cache_memory_bytes",
    "kv_cache_dtype",
    "num_gpu_blocks_override",
    "cpu_offload_gb",
}


# Settings the operator may have given for the same thing as a pattern's first key.
_RELATED = {
    "gpu_memory_utilization": _SIZES_KV_CACHE,
    "kv_offloading_size": {"kv_offloading_size", "swap_space"},
}


def blame(
    exc: BaseException, given: Iterable[str], names: Collection[str]
) -> EngineArgsError | None:
    """vLLM's refusal, as an EngineArgsError naming the settings to change, or None when
    it names none (a missing model, a bug: the caller keeps the original error).

    pydantic's errors carry the field; otherwise vLLM's message decides. The settings
    given come first among those named, so that the operator sees their own key.
    """
    given = list(given)
    message = _one_line(str(exc)) or type(exc).__name__
    fields = _pydantic_fields(exc, names)
    if fields:
        ordered = [k for k in fields if k in given] + [k for k in fields if k not in given]
        return EngineArgsError(ordered, message)
    for pattern, keys in _BLAME:
        if pattern.search(message):
            # Settings the operator gave that size the same thing come first.
            related = _RELATED.get(keys[0], set(keys))
            ordered = [k for k in given if k in related] + [k for k in keys if k not in given]
            return EngineArgsError(ordered, message)
    return None


def _pydantic_fields(exc: BaseException, names: Collection[str]) -> list[str]:
    errors = getattr(exc, "errors", None)
    if not callable(errors) or type(exc).__name__ != "ValidationError":
        return []
    found: list[str] = []
    try:
        for err in errors():
            for part in err.get("loc", ()):
                if isinstance(part, str) and part in names and part not in found:
                    found.append(part)
    except Exception:
        return []
    return found


def _one_line(text: str) -> str:
    return " ".join(text.split())
