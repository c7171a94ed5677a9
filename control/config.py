"""The serving configuration: YAML in, typed values out, errors that name the key.

```yaml
listen: 127.0.0.1:50051
metrics: {listen: 127.0.0.1:9400}   # Prometheus text at /metrics; off when absent
tracing: {otlp_endpoint: 127.0.0.1:4317}   # OTLP/gRPC; default: OTEL_EXPORTER_OTLP_*
tls: {cert: server.pem, key: server.key, client_ca: ca.pem}   # client_ca: mutual TLS
auth: {tokens_file: tokens.yaml}   # bearer tokens (control/api/auth.py); reloaded on change
api: {reflection: true, admin: true, max_message_bytes: 67108864, max_metadata_bytes: 16384,
      request_idle_s: 30, stream_interval: 1,   # stream_interval: tokens per chunk, at least
      front: auto}   # auto (native where the build has it) | native (grpc++) | python (grpc.aio)
health: {listen: 0.0.0.0:50052}   # grpc.health.v1 alone, plaintext, for probes (kubelet)
models:
  - name: tiny
    engine: vllm            # vllm | trtllm | sim (the C++ worker's simulator)
    model: builtin:tiny     # a model (or TensorRT-LLM engine) directory, or builtin:tiny
    tokenizer: /path        # optional, defaults to the model directory
    replicas: 1             # local worker processes to start
    engine_args: {max_model_len: 2048}   # vllm: any of vLLM's AsyncEngineArgs
    workers: []             # addresses of remote workers; when set, none is started
    routing: kv_aware       # kv_aware | least_load | prefix_affinity | power_of_two | round_robin
                            # | dynamo_cost | cache_aware (baselines for kv_aware; default:
                            # kv_aware if the workers report KV events, else least_load)
    kv_aware: {overlap_weight: 1, prefill_weight: 1, eviction_weight: 2, load_weight: 0.01}
    limits: {max_concurrency: 256, max_queue: 1024}
    health: {canary_interval_s: 5, canary_timeout_s: 2, failure_threshold: 3}
    discovery: {dns: workers.example:7001, interval_s: 10}   # every address behind a name
    worker_stream: true     # share one GenerateStream per worker (when it offers one)
    worker_tls: {ca: ca.pem, cert: client.pem, key: client.key, server_name: workers}
    chat_template: chat.jinja   # a file or the template itself; default: the tokenizer's
    gpus: [0, 1]            # CUDA_VISIBLE_DEVICES of the local workers, an equal share each
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from switchyard_common.wire import DEFAULT_MAX_METADATA_BYTES, DEFAULT_REQUEST_IDLE_S

ENGINES = ("vllm", "trtllm", "sim")
# output.stream_interval and api.stream_interval: tokens per streamed chunk, at most.
MAX_STREAM_INTERVAL = 1024
API_KEYS = {
    "reflection",
    "admin",
    "max_message_bytes",
    "max_metadata_bytes",
    "request_idle_s",
    "stream_interval",
    "front",
}
# api.front: what serves the public port. native: the grpc++ front (control/api/front.py),
# with the same handlers and every decision still in Python; python: grpc.aio; auto (the
# default): native where the build has the library, else python.
FRONTS = ("auto", "native", "python")
ROUTING_POLICIES = (
    "least_load",
    "prefix_affinity",
    "kv_aware",
    "power_of_two",
    "round_robin",
    # Baselines for kv_aware: Dynamo's published cost formula and SMG's cache-aware
    # thresholds, reimplemented (control/routing/dynamo_cost.py, cache_aware.py).
    "dynamo_cost",
    "cache_aware",
)
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("tiny",)
DEFAULT_LISTEN = "127.0.0.1:50051"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/]{0,127}$")
# What the C++ worker accepts for each of its engines; passed as --key-with-dashes value.
# vLLM's settings are whatever the installed vLLM's AsyncEngineArgs takes: the vLLM worker
# checks them against vLLM itself when it starts (pyworker/engine_args.py), types kept.
ENGINE_ARG_KEYS: dict[str, frozenset[str]] = {
    "sim": frozenset(
        {
            "vocab_size",
            "max_context",
            "eos_id",
            "eos_every",
            "eos_convention",
            "tokens_per_block",
            "kv_blocks",
            "max_batch",
            "prefill_us_per_token",
            "decode_step_us",
            "decode_us_per_request",
            "time_scale",
            "max_loras",
            "max_lora_rank",
            # Constraint kinds to declare (comma-separated); the simulator's tokens do not
            # follow them: for tests of what surrounds guided decoding.
            "structured_output",
        }
    ),
    # The engine's own config.json sets its limits; these may only lower them.
    "trtllm": frozenset(
        {
            "max_batch_size",
            "kv_cache_free_gpu_memory_fraction",
            "max_tokens_in_kv_cache",
            "enable_kv_cache_reuse",
            "enable_chunked_context",
            "scheduler_policy",
            "max_context",
            "tokens_per_block",
            "executor_worker",
            "eos_id",
            "max_loras",
            "max_lora_rank",
            "max_beam_width",
            "kv_event_buffer",
        }
    ),
}
_POSITIVE_INT_ARGS = frozenset(
    {
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "vocab_size",
        "max_context",
        "tokens_per_block",
        "kv_blocks",
        "max_batch",
        "max_batch_size",
        "max_tokens_in_kv_cache",
        "max_beam_width",
    }
)


class ConfigError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"config error at {key}: {message}")


@dataclass(frozen=True, slots=True)
class WorkerTls:
    """How the control plane reaches a model's workers over TLS."""

    ca: str | None = None  # the CA to trust (None: the system's roots)
    cert: str | None = None  # mutual TLS: the control plane's certificate and key
    key: str | None = None
    server_name: str | None = None  # the name the workers' certificates carry, if not
    # the address's host


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    engine: str
    model: str
    tokenizer: str | None = None
    replicas: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)
    workers: tuple[str, ...] = ()
    # The policy; "" is the default: kv_aware where the workers report KV-cache events,
    # least_load where they do not (ModelEntry decides, from the first worker's GetInfo,
    # when the model is loaded).
    routing: str = ""
    # kv_aware's cost weights and temperature (control/routing/kv_aware.py), as given
    kv_aware: tuple[tuple[str, float], ...] = ()
    max_concurrency: int = 256
    max_queue: int = 1024
    canary_interval_s: float = 5.0
    canary_timeout_s: float = 2.0
    failure_threshold: int = 3
    dns: str | None = None  # host:port re-resolved for workers (a headless Service)
    dns_interval_s: float = 10.0
    worker_stream: bool = True  # one GenerateStream per worker instead of a call per request
    worker_tls: WorkerTls | None = None  # TLS to the workers; None: plaintext
    chat_template: str | None = None  # Jinja, for `messages` prompts; None: the tokenizer's
    # CUDA_VISIBLE_DEVICES of the local workers, split evenly over the replicas; ():
    # they see what this process sees.
    gpus: tuple[str, ...] = ()

    @property
    def is_builtin(self) -> bool:
        return self.model.startswith(BUILTIN_PREFIX)

    def replica_gpus(self, replica: int) -> tuple[str, ...]:
        """The GPUs of local worker `replica` (0-based); () where none are assigned."""
        if not self.gpus:
            return ()
        share = len(self.gpus) // self.replicas
        return self.gpus[replica * share : (replica + 1) * share]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str  # PEM files
    key: str
    client_ca: str | None = None  # mutual TLS: clients must show a certificate it signed


DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServeConfig:
    listen: str = DEFAULT_LISTEN
    models: tuple[ModelSpec, ...] = ()
    metrics_listen: str | None = None  # host:port of the Prometheus endpoint; None: off
    # A plaintext port serving only grpc.health.v1, for probes that cannot speak TLS (the
    # kubelet's); None: health is on the public port only.
    health_listen: str | None = None
    otlp_endpoint: str | None = None  # where spans go (OTLP over gRPC); None: OTEL_* or off
    service_name: str = "switchyard-control"
    tls: TlsConfig | None = None
    tokens_file: str | None = None  # None: no authentication
    reflection: bool = True
    admin: bool = True
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_metadata_bytes: int = DEFAULT_MAX_METADATA_BYTES  # over it: RESOURCE_EXHAUSTED
    # How long a call may wait for its request message before DEADLINE_EXCEEDED.
    request_idle_s: float = DEFAULT_REQUEST_IDLE_S
    stream_interval: int = 1  # tokens per streamed chunk, at least (a request may ask more)
    front: str = "auto"  # FRONTS


def default_config(listen: str = DEFAULT_LISTEN) -> ServeConfig:
    """The embedded default: the generated tiny model on one local vLLM worker."""
    return ServeConfig(
        listen=listen,
        models=(ModelSpec(name="tiny", engine="vllm", model=BUILTIN_PREFIX + "tiny"),),
    )


def load_config(path: Path) -> ServeConfig:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(str(path), f"cannot read: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(str(path), f"not valid YAML: {e}") from e
    return parse_config(raw)


def parse_config(raw: object) -> ServeConfig:
    if not isinstance(raw, dict):
        raise ConfigError("<root>", "expected a mapping with 'models'")
    _no_unknown_keys(
        raw, {"listen", "models", "metrics", "tracing", "tls", "auth", "api", "health"}, ""
    )
    listen = raw.get("listen", DEFAULT_LISTEN)
    if not isinstance(listen, str) or not _is_address(listen):
        raise ConfigError("listen", f"expected host:port, got {listen!r}")
    metrics = _section(raw, "metrics", {"listen"}, "")
    metrics_listen = metrics.get("listen")
    if "metrics" in raw and metrics_listen is None:
        raise ConfigError("metrics.listen", "expected host:port (port 0: any free port)")
    if metrics_listen is not None and (
        not isinstance(metrics_listen, str) or not _is_address(metrics_listen, allow_zero=True)
    ):
        raise ConfigError("metrics.listen", f"expected host:port, got {metrics_listen!r}")
    health_listen = _section(raw, "health", {"listen"}, "").get("listen")
    if "health" in raw and (not isinstance(health_listen, str) or not _is_address(health_listen)):
        raise ConfigError("health.listen", f"expected host:port, got {health_listen!r}")
    tracing = _section(raw, "tracing", {"otlp_endpoint", "service_name"}, "")
    otlp = tracing.get("otlp_endpoint")
    if otlp is not None and (not isinstance(otlp, str) or not _is_endpoint(otlp)):
        raise ConfigError(
            "tracing.otlp_endpoint", f"expected host:port or http://host:port, got {otlp!r}"
        )
    service_name = tracing.get("service_name", "switchyard-control")
    if not isinstance(service_name, str) or not service_name:
        raise ConfigError("tracing.service_name", f"expected a name, got {service_name!r}")
    models_raw = raw.get("models")
    if not isinstance(models_raw, list) or not models_raw:
        raise ConfigError("models", "expected a non-empty list of models")
    models: list[ModelSpec] = []
    seen: set[str] = set()
    for i, m in enumerate(models_raw):
        spec = parse_model(m, f"models[{i}]")
        if spec.name in seen:
            raise ConfigError(f"models[{i}].name", f"duplicate model name {spec.name!r}")
        seen.add(spec.name)
        models.append(spec)
    auth = _section(raw, "auth", {"tokens_file"}, "")
    tokens_file = auth.get("tokens_file")
    if "auth" in raw and not (isinstance(tokens_file, str) and Path(tokens_file).is_file()):
        raise ConfigError("auth.tokens_file", f"expected a tokens file, got {tokens_file!r}")
    api = _section(raw, "api", API_KEYS, "")
    for flag in ("reflection", "admin"):
        if not isinstance(api.get(flag, True), bool):
            raise ConfigError(f"api.{flag}", f"expected true or false, got {api[flag]!r}")
    return ServeConfig(
        listen=listen,
        models=tuple(models),
        metrics_listen=metrics_listen,
        health_listen=health_listen,
        otlp_endpoint=otlp,
        service_name=service_name,
        tls=_tls(raw),
        tokens_file=tokens_file,
        reflection=api.get("reflection", True),
        admin=api.get("admin", True),
        max_message_bytes=_number(
            api, "max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES, "api", integer=True
        ),
        max_metadata_bytes=_number(
            api, "max_metadata_bytes", DEFAULT_MAX_METADATA_BYTES, "api", integer=True
        ),
        request_idle_s=float(_number(api, "request_idle_s", DEFAULT_REQUEST_IDLE_S, "api")),
        stream_interval=_stream_interval(api),
        front=_front(api),
    )


def _front(api: dict[str, Any]) -> str:
    value = api.get("front", "auto")
    if value not in FRONTS:
        raise ConfigError("api.front", f"expected one of {', '.join(FRONTS)}, got {value!r}")
    return str(value)


def _stream_interval(api: dict[str, Any]) -> int:
    value: int = _number(api, "stream_interval", 1, "api", integer=True)
    if value > MAX_STREAM_INTERVAL:
        raise ConfigError(
            "api.stream_interval", f"at most {MAX_STREAM_INTERVAL} tokens per chunk, got {value}"
        )
    return value


def _tls(raw: dict[str, Any]) -> TlsConfig | None:
    if "tls" not in raw:
        return None
    tls = _section(raw, "tls", {"cert", "key", "client_ca"}, "")
    files: dict[str, str] = {}
    for name in ("cert", "key", "client_ca"):
        value = tls.get(name)
        if value is None and name == "client_ca":
            continue
        if not isinstance(value, str) or not Path(value).is_file():
            raise ConfigError(f"tls.{name}", f"expected a PEM file, got {value!r}")
        files[name] = value
    return TlsConfig(**files)


def parse_model(m: object, key: str) -> ModelSpec:
    if not isinstance(m, dict):
        raise ConfigError(key, "expected a mapping")
    _no_unknown_keys(
        m,
        {
            "name",
            "engine",
            "model",
            "tokenizer",
            "replicas",
            "engine_args",
            "workers",
            "routing",
            "kv_aware",
            "limits",
            "health",
            "discovery",
            "worker_stream",
            "worker_tls",
            "chat_template",
            "gpus",
        },
        key,
    )
    name = m.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"{key}.name", f"expected a model name like 'llama-8b', got {name!r}")
    engine = m.get("engine")
    if engine not in ENGINES:
        raise ConfigError(
            f"{key}.engine", f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}"
        )
    model = m.get("model")
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{key}.model", "expected a model directory or builtin:tiny")
    workers_raw = m.get("workers", [])
    if not isinstance(workers_raw, list) or not all(isinstance(w, str) for w in workers_raw):
        raise ConfigError(f"{key}.workers", "expected a list of host:port addresses")
    for j, w in enumerate(workers_raw):
        if not _is_address(w):
            raise ConfigError(f"{key}.workers[{j}]", f"expected host:port, got {w!r}")
    if model.startswith(BUILTIN_PREFIX):
        if model[len(BUILTIN_PREFIX) :] not in BUILTIN_MODELS:
            raise ConfigError(
                f"{key}.model", f"unknown builtin model {model!r}; known: builtin:tiny"
            )
    elif (
        engine != "sim" and not workers_raw and not m.get("discovery") and not Path(model).is_dir()
    ):
        raise ConfigError(f"{key}.model", f"model directory {model!r} does not exist")
    if engine == "sim" and not model.startswith(BUILTIN_PREFIX) and m.get("tokenizer") is None:
        raise ConfigError(
            f"{key}.tokenizer", "a sim model needs a tokenizer (or model: builtin:tiny)"
        )
    tokenizer = m.get("tokenizer")
    if tokenizer is not None and (not isinstance(tokenizer, str) or not Path(tokenizer).is_dir()):
        raise ConfigError(f"{key}.tokenizer", f"tokenizer directory {tokenizer!r} does not exist")
    replicas = m.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= 64:
        raise ConfigError(f"{key}.replicas", f"expected an integer from 1 to 64, got {replicas!r}")
    engine_args = m.get("engine_args", {})
    if not isinstance(engine_args, dict):
        raise ConfigError(f"{key}.engine_args", "expected a mapping")
    if engine == "vllm":  # vLLM's own names and types: the worker checks them against vLLM
        _check_vllm_engine_args(engine_args, f"{key}.engine_args")
    else:
        _check_cpp_engine_args(engine, engine_args, f"{key}.engine_args")
    gpus = _gpus(m, key, engine, replicas, engine_args)
    routing = m.get("routing", "")
    if routing != "" and routing not in ROUTING_POLICIES:
        raise ConfigError(
            f"{key}.routing",
            f"unknown policy {routing!r}; expected one of {', '.join(ROUTING_POLICIES)}",
        )
    kv_aware = _section(
        m,
        "kv_aware",
        {"overlap_weight", "load_weight", "prefill_weight", "eviction_weight", "temperature"},
        key,
    )
    if kv_aware and routing not in ("kv_aware", ""):
        raise ConfigError(f"{key}.kv_aware", f"only with routing: kv_aware (not {routing})")
    kv_weights = tuple(
        (name, float(_number(kv_aware, name, 0, f"{key}.kv_aware", allow_zero=True)))
        for name in sorted(kv_aware)
    )
    limits = _section(m, "limits", {"max_concurrency", "max_queue"}, key)
    health = _section(
        m, "health", {"canary_interval_s", "canary_timeout_s", "failure_threshold"}, key
    )
    discovery = _section(m, "discovery", {"dns", "interval_s"}, key)
    dns = discovery.get("dns")
    if dns is not None and (not isinstance(dns, str) or not _is_address(dns)):
        raise ConfigError(f"{key}.discovery.dns", f"expected name:port, got {dns!r}")
    worker_stream = m.get("worker_stream", True)
    if not isinstance(worker_stream, bool):
        raise ConfigError(f"{key}.worker_stream", f"expected true or false, got {worker_stream!r}")
    return ModelSpec(
        name=name,
        engine=engine,
        model=model,
        tokenizer=tokenizer,
        replicas=replicas,
        engine_args=dict(engine_args),
        workers=tuple(workers_raw),
        routing=routing,
        kv_aware=kv_weights,
        max_concurrency=_number(limits, "max_concurrency", 256, f"{key}.limits", integer=True),
        max_queue=_number(
            limits, "max_queue", 1024, f"{key}.limits", integer=True, allow_zero=True
        ),
        canary_interval_s=_number(health, "canary_interval_s", 5.0, f"{key}.health"),
        canary_timeout_s=_number(health, "canary_timeout_s", 2.0, f"{key}.health"),
        failure_threshold=_number(health, "failure_threshold", 3, f"{key}.health", integer=True),
        dns=dns,
        dns_interval_s=_number(discovery, "interval_s", 10.0, f"{key}.discovery"),
        worker_stream=worker_stream,
        worker_tls=_worker_tls(m, key),
        chat_template=_chat_template(m.get("chat_template"), f"{key}.chat_template"),
        gpus=gpus,
    )


_GPU_ID_RE = re.compile(r"^(\d+|(GPU|MIG)-[0-9A-Za-z\-/]+)$")


def _gpus(
    m: dict[str, Any], key: str, engine: str, replicas: int, engine_args: dict[Any, Any]
) -> tuple[str, ...]:
    """The GPUs the model's local workers are started on, as CUDA_VISIBLE_DEVICES names
    them: an equal share for each replica, in order."""
    if "gpus" not in m:
        return ()
    where = f"{key}.gpus"
    raw = m["gpus"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(where, "expected a list of GPU indices or UUIDs, like [0, 1]")
    ids: list[str] = []
    for j, g in enumerate(raw):
        text = str(g) if isinstance(g, int) and not isinstance(g, bool) else g
        if not isinstance(text, str) or not _GPU_ID_RE.match(text):
            raise ConfigError(
                f"{where}[{j}]", f"expected a GPU index (0, 1, ...) or a GPU-/MIG- UUID, got {g!r}"
            )
        if text in ids:
            raise ConfigError(f"{where}[{j}]", f"GPU {text} is listed twice")
        ids.append(text)
    if engine == "sim":
        raise ConfigError(where, "the sim engine runs on no GPU")
    if m.get("workers") or m.get("discovery"):
        raise ConfigError(
            where, "only for workers this control plane starts (not with workers or discovery)"
        )
    if len(ids) % replicas:
        raise ConfigError(where, f"{len(ids)} GPUs do not split evenly over {replicas} replicas")
    share = len(ids) // replicas
    backend = engine_args.get("distributed_executor_backend")
    if engine == "vllm" and backend in (None, "mp", "uni"):
        world = 1
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            v = engine_args.get(name, 1)
            world *= v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 1
        if world > share:
            raise ConfigError(
                where,
                f"each of {replicas} replicas gets {share} of the {len(ids)} GPUs listed, but "
                "engine_args asks for tensor_parallel_size x pipeline_parallel_size x "
                f"data_parallel_size = {world}",
            )
    return tuple(ids)


def _chat_template(value: object, key: str) -> str | None:
    """A template file's text, or the template given inline."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, "expected a Jinja chat template, or a file holding one")
    if "{" not in value:  # no template syntax: a path
        try:
            return Path(value).read_text()
        except OSError as e:
            raise ConfigError(key, f"cannot read the template file {value!r}: {e.strerror}") from e
    return value


def _worker_tls(m: dict[str, Any], key: str) -> WorkerTls | None:
    if "worker_tls" not in m:
        return None
    sec = _section(m, "worker_tls", {"ca", "cert", "key", "server_name"}, key)
    for name in ("ca", "cert", "key"):
        value = sec.get(name)
        if value is not None and (not isinstance(value, str) or not Path(value).is_file()):
            raise ConfigError(f"{key}.worker_tls.{name}", f"expected a PEM file, got {value!r}")
    if ("cert" in sec) != ("key" in sec):
        raise ConfigError(f"{key}.worker_tls", "cert and key go together")
    server_name = sec.get("server_name")
    if server_name is not None and (not isinstance(server_name, str) or not server_name):
        raise ConfigError(f"{key}.worker_tls.server_name", f"expected a name, got {server_name!r}")
    return WorkerTls(**sec)


def _check_cpp_engine_args(engine: str, args: dict[Any, Any], key: str) -> None:
    """The C++ worker's flags for `engine`: known names, numbers or strings."""
    _no_unknown_keys(args, set(ENGINE_ARG_KEYS[engine]), key)
    for arg, v in args.items():
        where = f"{key}.{arg}"
        if arg in _POSITIVE_INT_ARGS:
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(where, f"expected a positive integer, got {v!r}")
        elif not isinstance(v, (int, float, str, bool)):
            raise ConfigError(where, f"expected a number or a string, got {v!r}")


_IDENTIFIER_RE = re.compile(r"^[a-z_][a-z0-9_]*$")


def _check_vllm_engine_args(args: dict[Any, Any], key: str) -> None:
    """Names shaped like vLLM's, and values that survive JSON (vLLM's nested settings,
    such as compilation_config, are mappings). The names themselves are checked by the
    worker against the vLLM it runs, which may be newer or older than this process's."""
    for arg, v in args.items():
        where = f"{key}.{arg}"
        if not isinstance(arg, str) or not _IDENTIFIER_RE.match(arg):
            raise ConfigError(where, "expected a vLLM engine argument name like max_model_len")
        if not _json_like(v):
            raise ConfigError(where, f"expected a number, string, list or mapping, got {v!r}")


def _json_like(v: object) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return not (isinstance(v, float) and v != v)
    if isinstance(v, list):
        return all(_json_like(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _json_like(x) for k, x in v.items())
    return False


def _section(m: dict[str, Any], name: str, allowed: set[str], key: str) -> dict[str, Any]:
    where = f"{key}.{name}" if key else name
    sec = m.get(name, {})
    if not isinstance(sec, dict):
        raise ConfigError(where, "expected a mapping")
    _no_unknown_keys(sec, allowed, where)
    return sec


def _number(
    sec: dict[str, Any],
    name: str,
    default: Any,
    key: str,
    integer: bool = False,
    allow_zero: bool = False,
) -> Any:
    v = sec.get(name, default)
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or not (v > 0 or (allow_zero and v == 0)):
        kind = "an integer" if integer else "a number"
        floor = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}.{name}", f"expected {kind} {floor}, got {v!r}")
    return v


def _no_unknown_keys(d: dict[Any, Any], allowed: set[str], key: str) -> None:
    for k in d:
        if k not in allowed:
            where = f"{key}.{k}" if key else str(k)
            raise ConfigError(where, f"unknown key; expected one of {', '.join(sorted(allowed))}")


def _is_endpoint(s: str) -> bool:
    for scheme in ("http://", "https://"):
        if s.startswith(scheme):
            return _is_address(s[len(scheme) :].rstrip("/"))
    return _is_address(s)


def _is_address(s: str, allow_zero: bool = False) -> bool:
    host, sep, port = s.rpartition(":")
    lowest = 0 if allow_zero else 1
    return bool(sep and host and port.isdigit() and lowest <= int(port) < 65536)
