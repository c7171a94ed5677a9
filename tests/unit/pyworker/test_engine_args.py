"""vLLM engine settings: names checked against the installed vLLM, the deployment
pitfalls refused before the engine starts, and vLLM's own refusals named by setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from pyworker.engine_args import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    EngineArgsError,
    Machine,
    ModelFacts,
    blame,
    engine_arg_names,
    resolve,
)

CPU = Machine("cpu", 0)
ONE_H200 = Machine("cuda", 1, capability=90)
LLAMA_8B = ModelFacts(
    max_position_embeddings=8192,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_hidden_layers=32,
    found=True,
)
# The settings the deployment guide discusses, with a value each.
GUIDE_SETTINGS = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "distributed_executor_backend": "mp",
    "quantization": "fp8",
    "kv_cache_dtype": "fp8",
    "max_model_len": 4096,
    "gpu_memory_utilization": 0.85,
    "swap_space": 4,
    "cpu_offload_gb": 0,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "load_format": "dummy",
    "enforce_eager": False,
    "seed": 0,
    "dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def names() -> frozenset[str]:
    return engine_arg_names()


def check(raw: dict[str, object], names: frozenset[str], **kw: object) -> EngineArgsError:
    machine = kw.pop("machine", ONE_H200)
    facts = kw.pop("facts", LLAMA_8B)
    with pytest.raises(EngineArgsError) as info:
        resolve(raw, "/models/llama", machine, names, facts)  # type: ignore[arg-type]
    return info.value


def test_every_setting_the_guide_discusses_passes_with_its_type(names: frozenset[str]) -> None:
    args = resolve(GUIDE_SETTINGS, "/models/llama", ONE_H200, names, LLAMA_8B)
    assert args["model"] == "/models/llama"
    assert args["enforce_eager"] is False and args["gpu_memory_utilization"] == 0.85
    assert args["kv_cache_dtype"] == "fp8" and args["quantization"] == "fp8"
    # swap_space is gone from vLLM's V1 engine; its memory goes to KV offloading.
    assert "swap_space" not in args and args["kv_offloading_size"] == 4.0
    assert all(k in names for k in args)


def test_swap_space_counts_per_gpu_like_it_did(names: frozenset[str]) -> None:
    four = Machine("cuda", 4, 90)
    raw = {"swap_space": 4, "tensor_parallel_size": 2, "pipeline_parallel_size": 2}
    args = resolve(raw, "/m", four, names, LLAMA_8B)
    assert args["kv_offloading_size"] == 16.0  # a total across ranks now
    error = check({"swap_space": 4, "kv_offloading_size": 2}, names)
    assert error.keys == ("swap_space", "kv_offloading_size")


def test_an_unknown_name_is_refused_with_the_nearest_one(names: frozenset[str]) -> None:
    error = check({"enforce_eagr": True}, names)
    assert error.keys == ("enforce_eagr",)
    assert "did you mean 'enforce_eager'?" in str(error)
    assert str(error).startswith("engine_args.enforce_eagr: not an engine argument of vLLM")


@pytest.mark.parametrize("key", ["model", "disable_log_stats"])
def test_settings_switchyard_owns_are_refused(names: frozenset[str], key: str) -> None:
    assert check({key: "x"}, names).keys == (key,)


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5])
def test_gpu_memory_utilization_is_a_fraction(names: frozenset[str], value: object) -> None:
    error = check({"gpu_memory_utilization": value}, names)
    assert error.keys == ("gpu_memory_utilization",) and "(0, 1]" in error.reason


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("gpu_memory_utilization", "0.9", "valid number, got '0.9'"),
        ("enforce_eager", 1, "valid boolean, got 1"),
        ("max_num_seqs", "many", "valid integer, got 'many'"),
        ("kv_cache_dtype", "fp7", "'fp8'"),  # vLLM's own choices
    ],
)
def test_values_have_the_type_vllm_declares(
    names: frozenset[str], key: str, value: object, said: str
) -> None:
    error = check({key: value}, names)
    assert error.keys == (key,) and said in error.reason


def test_gpu_memory_utilization_of_one_is_allowed(names: frozenset[str]) -> None:
    resolve({"gpu_memory_utilization": 1}, "/m", ONE_H200, names, LLAMA_8B)


def test_more_gpus_than_visible_is_refused_unless_on_ray(names: frozenset[str]) -> None:
    error = check({"tensor_parallel_size": 2}, names)
    assert error.keys == ("tensor_parallel_size", "pipeline_parallel_size")
    assert "2 GPUs, but 1 are visible" in error.reason and "ray" in error.reason
    error = check({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, names)
    assert "= 8 GPUs" in error.reason
    ray = {"tensor_parallel_size": 8, "distributed_executor_backend": "ray"}
    assert resolve(ray, "/m", ONE_H200, names, LLAMA_8B)["tensor_parallel_size"] == 8


def test_a_parallel_size_must_divide_the_heads(names: frozenset[str]) -> None:
    eight = Machine("cuda", 8, 90)
    error = check({"tensor_parallel_size": 3}, names, machine=eight)
    assert error.keys == ("tensor_parallel_size",)
    assert "does not divide the model's 32 attention heads" in error.reason
    assert "[1, 2, 4, 8, 16, 32]" in error.reason


def test_kv_heads_replicate_when_tp_is_a_multiple(names: frozenset[str]) -> None:
    eight = Machine("cuda", 8, 90)
    facts = ModelFacts(num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=32)
    resolve({"tensor_parallel_size": 8}, "/m", eight, names, facts)
    facts = ModelFacts(num_attention_heads=48, num_key_value_heads=8, num_hidden_layers=32)
    error = check({"tensor_parallel_size": 12}, names, machine=Machine("cuda", 12, 90), facts=facts)
    assert "KV heads" in error.reason


def test_more_pipeline_stages_than_layers_is_refused(names: frozenset[str]) -> None:
    facts = ModelFacts(num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    error = check({"pipeline_parallel_size": 4}, names, machine=Machine("cuda", 4, 90), facts=facts)
    assert error.keys == ("pipeline_parallel_size",) and "2 layers" in error.reason


def test_a_quantization_the_checkpoint_lacks_is_refused(names: frozenset[str]) -> None:
    error = check({"quantization": "awq"}, names)
    assert error.keys == ("quantization",)
    assert "needs a checkpoint quantized with it" in error.reason and "fp8" in error.reason
    awq = ModelFacts(num_attention_heads=32, quant_method="awq", found=True)
    resolve({"quantization": "awq"}, "/m", ONE_H200, names, awq)
    resolve({"quantization": "fp8"}, "/m", ONE_H200, names, LLAMA_8B)  # quantized at load


def test_an_unknown_quantization_names_the_nearest(names: frozenset[str]) -> None:
    error = check({"quantization": "fp9"}, names)
    assert "not a quantization method" in error.reason and "'fp8'" in error.reason


def test_a_quantization_the_gpu_cannot_run_is_refused(names: frozenset[str]) -> None:
    old_gpu = Machine("cuda", 1, capability=60)  # a Pascal card
    error = check({"quantization": "fp8"}, names, machine=old_gpu)
    assert error.keys == ("quantization",) and "compute capability" in error.reason


def test_model_facts_come_from_config_json(tiny_model_dir: Path) -> None:
    facts = ModelFacts.read(str(tiny_model_dir))
    assert facts.max_position_embeddings == 2048
    assert (facts.num_attention_heads, facts.num_key_value_heads) == (4, 2)
    assert ModelFacts.read("/no/such/model") == ModelFacts()


def test_cpu_keeps_prompts_in_one_prefill_step(names: frozenset[str], tiny_model_dir: Path) -> None:
    args = resolve({}, str(tiny_model_dir), CPU, names)
    assert args["max_num_batched_tokens"] == CPU_MAX_NUM_BATCHED_TOKENS
    args = resolve({}, str(tiny_model_dir), ONE_H200, names)
    assert "max_num_batched_tokens" not in args  # vLLM's own default on GPUs


def vllm_refusal(tiny_model_dir: Path, **kwargs: object) -> BaseException:
    from vllm.engine.arg_utils import AsyncEngineArgs

    with pytest.raises(Exception) as info:
        AsyncEngineArgs(model=str(tiny_model_dir), **kwargs).create_engine_config()  # type: ignore[arg-type]
    return info.value


def test_vllm_refusing_max_model_len_names_it(names: frozenset[str], tiny_model_dir: Path) -> None:
    exc = vllm_refusal(tiny_model_dir, max_model_len=4096)
    error = blame(exc, ["max_model_len"], names)
    assert error is not None
    assert error.keys[0] == "max_model_len"
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in error.reason  # vLLM's way to override


def test_vllm_config_errors_name_the_field(names: frozenset[str], tiny_model_dir: Path) -> None:
    exc = vllm_refusal(tiny_model_dir, max_logprobs=-2)  # vLLM's pydantic config refuses it
    error = blame(exc, ["max_logprobs"], names)
    assert error is not None
    assert error.keys == ("max_logprobs",) and "greater than or equal to -1" in error.reason


def test_a_kv_cache_too_small_names_the_settings_to_change(names: frozenset[str]) -> None:
    said = (
        "ValueError: To serve at least one request with the model's max seq len (2048), "
        "(0.5 GiB KV cache is needed, which is larger than the available KV cache memory"
    )
    error = blame(RuntimeError(said), ["max_model_len"], names)
    assert error is not None
    assert error.keys == ("max_model_len", "gpu_memory_utilization")
    assert str(error).startswith("engine_args.max_model_len / engine_args.gpu_memory_utilization")


def test_swap_space_on_the_cpu_is_ignored(names: frozenset[str]) -> None:
    args = resolve({"swap_space": 4}, "/m", CPU, names, LLAMA_8B)
    assert "swap_space" not in args and "kv_offloading_size" not in args


def test_a_kv_offloading_refusal_names_the_setting_given(names: frozenset[str]) -> None:
    said = "RuntimeError: Worker failed with error 'CPU Offloading is currently only supported"
    error = blame(RuntimeError(said), ["swap_space"], names)
    assert error is not None
    assert error.keys == ("swap_space", "kv_offloading_size")


def test_an_error_vllm_does_not_pin_on_a_setting_is_not_blamed_on_one(
    names: frozenset[str],
) -> None:
    assert blame(FileNotFoundError("no such model"), ["seed"], names) is None


def test_enum_settings_take_their_values(names: frozenset[str]) -> None:
    if "optimization_level" not in names:
        pytest.skip("this vLLM has no optimization_level (an enum-typed setting)")
    resolve({"optimization_level": 2}, "/m", ONE_H200, names, LLAMA_8B)


def test_a_hub_name_is_not_taken_for_an_unquantized_checkpoint(names: frozenset[str]) -> None:
    facts = ModelFacts.read("TheBloke/Llama-2-7B-AWQ")  # no config.json here to read
    assert not facts.found
    resolve({"quantization": "awq"}, "TheBloke/Llama-2-7B-AWQ", ONE_H200, names, facts)
