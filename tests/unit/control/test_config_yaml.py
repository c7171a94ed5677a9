"""The config back to YAML (control/config_yaml.py): what the parser reads back is what
was dumped. Nothing is started."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from switchyard.v1 import admin_pb2

from control.config import (
    ModelSpec,
    ServeConfig,
    default_config,
    load_config,
    parse_config,
    parse_model,
)
from control.config_yaml import (
    config_to_yaml,
    dump_config,
    model_message_to_yaml,
    model_to_yaml,
)


def round_trip(config: ServeConfig, tmp_path: Path) -> ServeConfig:
    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(config))
    return load_config(path)


def test_the_default_config_comes_back(tmp_path: Path) -> None:
    config = default_config()
    assert round_trip(config, tmp_path) == config
    # Only what differs from the defaults is written.
    assert config_to_yaml(config) == {
        "listen": "127.0.0.1:50051",
        "models": [{"name": "tiny", "engine": "vllm", "model": "builtin:tiny"}],
    }


@pytest.fixture
def rich(tmp_path: Path) -> ServeConfig:
    """A config with every section set, parsed as `switchyard serve` parses it."""
    for name in ("server.pem", "server.key", "ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_text("PEM\n")
    (tmp_path / "tokens.yaml").write_text("tokens: []\n")
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    t = tmp_path
    text = f"""
listen: 0.0.0.0:7000
metrics: {{listen: 127.0.0.1:0}}
tracing: {{otlp_endpoint: http://collector:4317, service_name: edge}}
tls: {{cert: {t}/server.pem, key: {t}/server.key, client_ca: {t}/ca.pem}}
auth: {{tokens_file: {t}/tokens.yaml}}
api: {{reflection: false, admin: false, max_message_bytes: 1024, max_metadata_bytes: 512,
      request_idle_s: 2.5, stream_interval: 2, front: python}}
health: {{listen: 0.0.0.0:7001}}
models:
  - name: llama
    engine: vllm
    model: {model_dir}
    tokenizer: {model_dir}
    replicas: 2
    engine_args: {{max_model_len: 2048, tensor_parallel_size: 2, enforce_eager: true,
                   compilation_config: {{level: 3, sizes: [1, 2]}}, kv_cache_dtype: fp8}}
    routing: kv_aware
    kv_aware: {{overlap_weight: 2, load_weight: 0.5, temperature: 0}}
    limits: {{max_concurrency: 64, max_queue: 0}}
    health: {{canary_interval_s: 1.5, canary_timeout_s: 0.5, failure_threshold: 5}}
    worker_stream: false
    chat_template: {t}/chat.jinja
    gpus: [0, 1, 2, GPU-abc-123]
  - name: remote
    engine: trtllm
    model: /nowhere/engine
    workers: [10.0.0.1:7001, 10.0.0.2:7001]
    routing: prefix_affinity
    worker_tls: {{ca: {t}/ca.pem, cert: {t}/client.pem, key: {t}/client.key,
                  server_name: workers}}
    engine_args: {{max_batch_size: 8, kv_cache_free_gpu_memory_fraction: 0.8}}
  - name: found
    engine: sim
    model: builtin:tiny
    discovery: {{dns: workers.local:7001, interval_s: 3}}
    engine_args: {{decode_step_us: 500, structured_output: "regex,json"}}
    routing: round_robin
  - name: quiet
    engine: sim
    model: builtin:tiny
    discovery: {{interval_s: 4}}
"""
    return parse_config(yaml.safe_load(text))


def test_a_config_with_every_section_comes_back(rich: ServeConfig, tmp_path: Path) -> None:
    assert rich.tls is not None and rich.tls.client_ca and rich.tokens_file
    assert [m.name for m in rich.models] == ["llama", "remote", "found", "quiet"]
    back = round_trip(rich, tmp_path)
    assert back == rich
    # Every field differs from its default somewhere, so every key was written and read.
    for f in dataclasses.fields(ServeConfig):
        if f.name != "models":
            assert getattr(rich, f.name) != getattr(ServeConfig(), f.name), f.name
    default_model = ModelSpec(name="", engine="", model="")
    for f in dataclasses.fields(ModelSpec):
        assert any(getattr(m, f.name) != getattr(default_model, f.name) for m in rich.models), (
            f.name
        )
    # Twice is the same as once.
    assert config_to_yaml(back) == config_to_yaml(rich)


def test_each_model_comes_back_alone(rich: ServeConfig) -> None:
    for i, spec in enumerate(rich.models):
        assert parse_model(model_to_yaml(spec), f"models[{i}]") == spec


def test_a_chat_template_file_comes_back_as_its_text(rich: ServeConfig) -> None:
    dumped = model_to_yaml(rich.models[0])["chat_template"]
    assert dumped.startswith("{% for m in messages %}")


def test_admin_model_spec_fields_are_the_config_keys(rich: ServeConfig) -> None:
    """Admin's LoadModel takes a ModelSpec message whose fields are the config's keys:
    one set in each field reads as the config's model would."""
    spec = admin_pb2.ModelSpec(
        name="m",
        engine="vllm",
        model="builtin:tiny",
        tokenizer="",
        replicas=2,
        workers=[],
        routing="least_load",
        gpus=["0", "1"],
    )
    spec.engine_args.update({"max_model_len": 128, "compilation_config": {"level": 3}})
    spec.limits.update({"max_concurrency": 8, "max_queue": 0})
    spec.health.update({"canary_interval_s": 1.5, "failure_threshold": 4})
    raw = model_message_to_yaml(spec)
    assert raw == {
        "name": "m",
        "engine": "vllm",
        "model": "builtin:tiny",
        "replicas": 2,
        "engine_args": {"max_model_len": 128, "compilation_config": {"level": 3.0}},
        "routing": "least_load",
        "limits": {"max_concurrency": 8, "max_queue": 0},
        "health": {"canary_interval_s": 1.5, "failure_threshold": 4},
        "gpus": ["0", "1"],
    }
    parsed = parse_model(raw, "spec")
    assert (parsed.max_concurrency, parsed.max_queue, parsed.failure_threshold) == (8, 0, 4)
    # Every field of the message is one of the config's keys (the rich config's models
    # write them all), so none can drift into a key the parser refuses.
    keys = {key for m in rich.models for key in model_to_yaml(m)}
    assert {f.name for f in admin_pb2.ModelSpec.DESCRIPTOR.fields} <= keys
    # An empty spec names what is missing, as the config does.
    assert model_message_to_yaml(admin_pb2.ModelSpec()) == {"name": "", "engine": "", "model": ""}
