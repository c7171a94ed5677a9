"""The serving configuration back to YAML: the inverse of the parser in control/config.py.

`config_to_yaml(config)` and `model_to_yaml(spec)` give the mapping that `parse_config`
and `parse_model` read back to an equal value (`dump_config` as YAML text, for
`load_config`). A key is written where its value is not the default, so a dump reads
like a config someone wrote. `model_message_to_yaml` reads Admin's `ModelSpec` message,
whose field names are the config's keys, as that same mapping.

A chat template given as a file comes back as the file's text, which the parser takes
inline where it holds a `{` (Jinja's syntax; a template without one would be read as a
path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from control.config import API_KEYS, ModelSpec, ServeConfig, TlsConfig, WorkerTls

_DEFAULT_CONFIG = ServeConfig()
_DEFAULT_MODEL = ModelSpec(name="", engine="", model="")


def dump_config(config: ServeConfig) -> str:
    """`config` as a YAML file that `load_config` reads back to an equal value."""
    return yaml.safe_dump(config_to_yaml(config), sort_keys=False)


def config_to_yaml(config: ServeConfig) -> dict[str, Any]:
    """`config` as the mapping `parse_config` reads back to an equal value."""
    c = config
    out: dict[str, Any] = {"listen": c.listen}
    if c.metrics_listen is not None:
        out["metrics"] = {"listen": c.metrics_listen}
    if tracing := _changed(c, _DEFAULT_CONFIG, "otlp_endpoint", "service_name"):
        out["tracing"] = tracing
    if c.tls is not None:
        out["tls"] = _files(c.tls)
    if c.tokens_file is not None:
        out["auth"] = {"tokens_file": c.tokens_file}
    api = _changed(c, _DEFAULT_CONFIG, *_API_FIELDS)
    if api:
        out["api"] = api
    if c.health_listen is not None:
        out["health"] = {"listen": c.health_listen}
    out["models"] = [model_to_yaml(spec) for spec in c.models]
    return out


def model_to_yaml(spec: ModelSpec) -> dict[str, Any]:
    """One model as the mapping `parse_model` reads back to an equal value."""
    s = spec
    out: dict[str, Any] = {"name": s.name, "engine": s.engine, "model": s.model}
    out |= _changed(s, _DEFAULT_MODEL, "tokenizer", "replicas")
    if s.engine_args:
        out["engine_args"] = dict(s.engine_args)
    if s.workers:
        out["workers"] = list(s.workers)
    out |= _changed(s, _DEFAULT_MODEL, "routing")
    if s.kv_aware:
        out["kv_aware"] = dict(s.kv_aware)
    for section, fields in _MODEL_SECTIONS.items():
        if values := _changed(s, _DEFAULT_MODEL, *fields):
            out[section] = values
    out |= _changed(s, _DEFAULT_MODEL, "worker_stream")
    if s.worker_tls is not None:
        out["worker_tls"] = _files(s.worker_tls)
    out |= _changed(s, _DEFAULT_MODEL, "chat_template")
    if s.gpus:
        out["gpus"] = list(s.gpus)
    return out


def model_message_to_yaml(spec: Message) -> dict[str, Any]:
    """Admin's `ModelSpec` message, whose field names are the config's keys, as the
    config's mapping, for `parse_model`: fields left unset are left out, but for the name,
    engine and model, which the parser then names as missing; a Struct's whole numbers
    are ints again (Struct numbers are doubles), for the keys that take ints."""
    raw: dict[str, Any] = {"name": "", "engine": "", "model": ""}
    raw |= json_format.MessageToDict(spec, preserving_proto_field_name=True)
    for field in spec.DESCRIPTOR.fields:
        if field.name in raw and field.message_type is not None:
            if field.message_type.full_name == "google.protobuf.Struct":
                raw[field.name] = {
                    k: int(v) if isinstance(v, float) and v.is_integer() else v
                    for k, v in raw[field.name].items()
                }
    return raw


# ServeConfig's fields under `api:`, and a model's under its sections (the YAML's key is
# the field's name, but for `discovery.interval_s`).
_API_FIELDS = tuple(sorted(API_KEYS))
_MODEL_SECTIONS = {
    "limits": ("max_concurrency", "max_queue"),
    "health": ("canary_interval_s", "canary_timeout_s", "failure_threshold"),
    "discovery": ("dns", "dns_interval_s"),
}
_YAML_KEY = {"dns_interval_s": "interval_s"}


def _changed(value: Any, default: Any, *fields: str) -> dict[str, Any]:
    """Those of `fields` whose values differ from `default`'s, under their YAML keys."""
    return {
        _YAML_KEY.get(name, name): getattr(value, name)
        for name in fields
        if getattr(value, name) != getattr(default, name)
    }


def _files(tls: TlsConfig | WorkerTls) -> dict[str, Any]:
    """A TLS section: its files (and server name) that are set."""
    return {k: v for k, v in dataclasses.asdict(tls).items() if v is not None}
