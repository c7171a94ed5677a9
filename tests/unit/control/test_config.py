"""The YAML config: good ones parse, bad ones fail at start naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from control.config import ConfigError, default_config, load_config, parse_config


def model(**kw: object) -> dict[str, object]:
    m: dict[str, object] = {"name": "tiny", "engine": "vllm", "model": "builtin:tiny"}
    m.update(kw)
    return m


def test_default_config_is_the_tiny_model() -> None:
    c = default_config()
    assert c.listen == "127.0.0.1:50051"
    assert [(m.name, m.engine, m.model) for m in c.models] == [("tiny", "vllm", "builtin:tiny")]


def test_full_model_spec(tmp_path: Path) -> None:
    c = parse_config(
        {
            "listen": "0.0.0.0:6000",
            "models": [
                model(
                    model=str(tmp_path),
                    replicas=2,
                    engine_args={"max_model_len": 1024, "dtype": "float32"},
                ),
                model(name="remote", workers=["10.0.0.1:7000", "worker-b:7000"]),
            ],
        }
    )
    assert c.listen == "0.0.0.0:6000"
    assert c.models[0].replicas == 2 and c.models[0].engine_args["max_model_len"] == 1024
    assert c.models[1].workers == ("10.0.0.1:7000", "worker-b:7000")


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ([], "<root>"),
        ({"models": []}, "models"),
        ({"listen": "nowhere", "models": [model()]}, "listen"),
        ({"models": [model()], "extra": 1}, "extra"),
        ({"models": [model()], "metrics": {}}, "metrics.listen"),
        ({"models": [model()], "tls": {"cert": "/no/cert.pem", "key": "/no/k"}}, "tls.cert"),
        ({"models": [model()], "tls": {"cert": __file__}}, "tls.key"),
        ({"models": [model()], "auth": {"tokens_file": "/no/tokens.yaml"}}, "auth.tokens_file"),
        ({"models": [model()], "auth": {"tokens": []}}, "auth.tokens"),
        ({"models": [model()], "api": {"admin": "no"}}, "api.admin"),
        ({"models": [model()], "health": {"listen": "50052"}}, "health.listen"),
        ({"models": [model(chat_template="/no/chat.jinja")]}, "models[0].chat_template"),
        ({"models": [model(chat_template=7)]}, "models[0].chat_template"),
        ({"models": [model()], "api": {"max_message_bytes": 0}}, "api.max_message_bytes"),
        ({"models": [model()], "api": {"max_metadata_bytes": 1.5}}, "api.max_metadata_bytes"),
        ({"models": [model()], "api": {"request_idle_s": 0}}, "api.request_idle_s"),
        ({"models": [model()], "api": {"stream_interval": 0}}, "api.stream_interval"),
        ({"models": [model()], "api": {"stream_interval": 1025}}, "api.stream_interval"),
        ({"models": [model()], "api": {"front": "rust"}}, "api.front"),
        ({"models": [model()], "tracing": {"otlp_endpoint": "nowhere"}}, "tracing.otlp_endpoint"),
        ({"models": [model(worker_tls={"ca": "/no/ca.pem"})]}, "models[0].worker_tls.ca"),
        ({"models": [model(worker_tls={"cert": __file__})]}, "models[0].worker_tls"),
        ({"models": [model(worker_tls={"server_name": ""})]}, "models[0].worker_tls.server_name"),
        ({"models": [model(worker_tls={"verify": False})]}, "models[0].worker_tls.verify"),
        ({"models": [model()], "metrics": "9400"}, "metrics"),
        ({"models": [model()], "metrics": {"listen": "9400"}}, "metrics.listen"),
        ({"models": [model()], "metrics": {"listen": "h:1", "path": "/m"}}, "metrics.path"),
        ({"models": [model(engine="vlm")]}, "models[0].engine"),
        ({"models": [model(model="/no/such/dir")]}, "models[0].model"),
        ({"models": [model(model="builtin:huge")]}, "models[0].model"),
        ({"models": [model(), model()]}, "models[1].name"),
        ({"models": [model(name="bad name!")]}, "models[0].name"),
        ({"models": [model(replicas=0)]}, "models[0].replicas"),
        ({"models": [model(replicas="two")]}, "models[0].replicas"),
        # vLLM's names and types are checked by the worker against the vLLM it runs
        # (tests/unit/pyworker/test_engine_args.py); here, only their shape.
        (
            {"models": [model(engine_args={"Max-Model-Len": 1})]},
            "models[0].engine_args.Max-Model-Len",
        ),
        (
            {"models": [model(engine_args={"compilation_config": {1: 2}})]},
            "models[0].engine_args.compilation_config",
        ),
        (
            {"models": [model(engine="trtllm", model=".", engine_args={"nonsense": 1})]},
            "models[0].engine_args.nonsense",
        ),
        ({"models": [model(workers=["no-port"])]}, "models[0].workers[0]"),
        ({"models": [model(tokenizer="/no/such/tok")]}, "models[0].tokenizer"),
        ({"models": [model(engine="sim", model="sim-label")]}, "models[0].tokenizer"),
        (
            {"models": [model(engine="sim", engine_args={"max_model_len": 9})]},
            "models[0].engine_args.max_model_len",
        ),
        ({"models": [model(engine="trtllm", model="/no/engine")]}, "models[0].model"),
        ({"models": [model(routing="fastest")]}, "models[0].routing"),
        (
            {"models": [model(routing="least_load", kv_aware={"load_weight": 1})]},
            "models[0].kv_aware",
        ),
        (
            {"models": [model(routing="kv_aware", kv_aware={"load_weight": -1})]},
            "models[0].kv_aware.load_weight",
        ),
        (
            {"models": [model(routing="kv_aware", kv_aware={"overlap": 1})]},
            "models[0].kv_aware.overlap",
        ),
        ({"models": [model(limits={"max_queue": -1})]}, "models[0].limits.max_queue"),
        ({"models": [model(limits={"max_concurrency": 0})]}, "models[0].limits.max_concurrency"),
        ({"models": [model(limits={"burst": 3})]}, "models[0].limits.burst"),
        (
            {"models": [model(health={"canary_interval_s": "often"})]},
            "models[0].health.canary_interval_s",
        ),
        ({"models": [model(discovery={"dns": "no-port"})]}, "models[0].discovery.dns"),
        (
            {"models": [model(engine="sim", engine_args={"kv_blocks": 0})]},
            "models[0].engine_args.kv_blocks",
        ),
    ],
)
def test_bad_config_names_the_key(raw: object, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    assert info.value.key == key
    assert key in str(info.value)


def test_kv_aware_takes_its_weights_from_the_models_config() -> None:
    from control.routing import make_policy
    from control.routing.kv_aware import LOAD_WEIGHT, KvAware

    spec = parse_config(
        {"models": [model(routing="kv_aware", kv_aware={"load_weight": 0.1, "temperature": 0})]}
    ).models[0]
    assert spec.kv_aware == (("load_weight", 0.1), ("temperature", 0.0))
    policy = make_policy(spec.routing, dict(spec.kv_aware))
    assert isinstance(policy, KvAware)
    assert (policy.overlap_weight, policy.load_weight, policy.temperature) == (1.0, 0.1, 0.0)
    plain = make_policy("kv_aware", {})
    assert isinstance(plain, KvAware) and plain.load_weight == LOAD_WEIGHT


def test_metrics_listen() -> None:
    assert parse_config({"models": [model()]}).metrics_listen is None  # off by default
    c = parse_config({"models": [model()], "metrics": {"listen": "0.0.0.0:9400"}})
    assert c.metrics_listen == "0.0.0.0:9400"
    # Port 0: any free port (its address is logged).
    assert parse_config({"models": [model()], "metrics": {"listen": "127.0.0.1:0"}}).metrics_listen


def test_engine_args_are_per_engine() -> None:
    c = parse_config(
        {
            "models": [
                model(name="s", engine="sim", engine_args={"decode_step_us": 500, "kv_blocks": 64}),
                model(
                    name="t",
                    engine="trtllm",
                    workers=["gpu-0:7001"],
                    engine_args={"scheduler_policy": "max_utilization"},
                ),
            ]
        }
    )
    assert c.models[0].engine_args == {"decode_step_us": 500, "kv_blocks": 64}
    assert c.models[1].engine == "trtllm"


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize(
    ("gpus", "extra", "key", "reason"),
    [
        ("0,1", {}, "models[0].gpus", "expected a list"),
        ([], {}, "models[0].gpus", "expected a list"),
        ([0, "cuda:1"], {}, "models[0].gpus[1]", "GPU index"),
        ([0, True], {}, "models[0].gpus[1]", "GPU index"),
        ([0, 0], {}, "models[0].gpus[1]", "listed twice"),
        ([0, 1, 2], {"replicas": 2}, "models[0].gpus", "do not split evenly over 2 replicas"),
        ([0], {"workers": ["h:1"]}, "models[0].gpus", "only for workers this control plane"),
        ([0], {"engine": "sim"}, "models[0].gpus", "the sim engine runs on no GPU"),
        (
            [0, 1],
            {"replicas": 2, "engine_args": {"tensor_parallel_size": 2}},
            "models[0].gpus",
            "each of 2 replicas gets 1 of the 2 GPUs listed, but engine_args asks for "
            "tensor_parallel_size x pipeline_parallel_size x data_parallel_size = 2",
        ),
    ],
)
def test_gpus_a_model_cannot_be_given_name_the_key_and_why(
    gpus: object, extra: dict[str, object], key: str, reason: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"models": [model(gpus=gpus, **extra)]})
    assert info.value.key == key
    assert reason in str(info.value)


def test_gpus_split_evenly_over_the_replicas_in_order() -> None:
    raw = model(
        replicas=2, gpus=[3, 2, "GPU-5f1c0a7e-aaaa", 0], engine_args={"tensor_parallel_size": 2}
    )
    (spec,) = parse_config({"models": [raw]}).models
    assert spec.gpus == ("3", "2", "GPU-5f1c0a7e-aaaa", "0")
    assert [spec.replica_gpus(i) for i in range(2)] == [("3", "2"), ("GPU-5f1c0a7e-aaaa", "0")]
    # Ray places its own ranks, across machines: only the split is checked then.
    ray = model(
        gpus=[0], engine_args={"tensor_parallel_size": 8, "distributed_executor_backend": "ray"}
    )
    assert parse_config({"models": [ray]}).models[0].gpus == ("0",)
    (plain,) = parse_config({"models": [model()]}).models
    assert plain.gpus == () and plain.replica_gpus(0) == ()


def test_the_transport_limits_load_and_a_bad_one_names_its_key(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(
        "api: {max_metadata_bytes: 8192, request_idle_s: 2.5, stream_interval: 4}\n"
        "models: [{name: m, engine: sim, model: builtin:tiny}]\n"
    )
    loaded = load_config(config)
    assert (loaded.max_metadata_bytes, loaded.request_idle_s) == (8192, 2.5)
    assert loaded.stream_interval == 4
    assert loaded.front == "auto"  # the default: native where the build has it
    config.write_text(
        "api: {front: native}\nmodels: [{name: m, engine: sim, model: builtin:tiny}]\n"
    )
    assert load_config(config).front == "native"
    config.write_text(
        "api: {max_metadata_bytes: 1.5}\nmodels: [{name: m, engine: sim, model: builtin:tiny}]\n"
    )
    with pytest.raises(ConfigError, match=r"api\.max_metadata_bytes: expected an integer > 0"):
        load_config(config)
