"""What a model's engine can do, checked before any worker is called: the capabilities
its workers declare (GetInfo), and the LoRA adapters they hold."""

from __future__ import annotations

from control.errors import AdapterNotFound, FailedPrecondition, InvalidArgument
from control.fleet.models import ModelEntry
from control.text.params import GenerationParams


def check_capabilities(entry: ModelEntry, params: GenerationParams) -> None:
    """Refuse, before any worker is called, what the model's engine cannot do (as its
    workers declare it): FAILED_PRECONDITION for a missing feature, INVALID_ARGUMENT for
    a value beyond the engine's own limit; both name the field and the engine."""
    caps = entry.info.capabilities
    if caps is None:  # workers from before capabilities: they judge for themselves
        return
    engine = f"model {entry.name!r} ({entry.info.label})"
    if params.logprobs is not None and params.logprobs > caps.max_logprobs:
        if caps.max_logprobs == 0:
            raise FailedPrecondition(
                f"output.logprobs: {engine} returns the sampled token's log probability only, "
                f"not {params.logprobs} alternatives (ask for 0)",
                field="output.logprobs",
            )
        raise InvalidArgument.for_field(
            "output.logprobs",
            f"{engine} returns at most {caps.max_logprobs} alternatives, got {params.logprobs}",
        )
    wanted = params.prompt_logprobs
    if wanted is not None and not caps.prompt_logprobs:
        raise FailedPrecondition(
            f"output.prompt_logprobs: {engine} does not return the prompt's log probabilities",
            field="output.prompt_logprobs",
        )
    if wanted is not None and wanted > caps.max_logprobs:
        raise InvalidArgument.for_field(
            "output.prompt_logprobs",
            f"{engine} returns at most {caps.max_logprobs} alternatives, got {wanted}",
        )
    constraint = params.constraint
    if constraint is not None and constraint.kind not in caps.structured_output:
        takes = ", ".join(sorted(caps.structured_output)) or "none"
        raise FailedPrecondition(
            f"{constraint.field}: {engine} does not constrain its output by "
            f"{constraint.kind} (structured output it takes: {takes})",
            field=constraint.field,
        )
    if params.beam_width > 1 and not caps.beam_search:
        raise FailedPrecondition(f"beam_width: {engine} has no beam search", field="beam_width")
    if params.beam_width > caps.max_beam_width > 0:
        raise InvalidArgument.for_field(
            "beam_width",
            f"{engine} searches at most {caps.max_beam_width} beams, got {params.beam_width}",
        )
    if params.adapter and not caps.lora:
        raise FailedPrecondition(
            f"adapter: {engine} has no LoRA (its engine was not started with it)",
            field="adapter",
        )


async def check_adapter(entry: ModelEntry, params: GenerationParams) -> None:
    """NOT_FOUND for an adapter no worker of the model holds. A router process asks the
    supervisor once before it says so: the adapter may have been loaded since it looked."""
    name = params.adapter
    # The supervisor knows what its models should hold: an adapter being given back to a
    # restarted worker is there (routing answers UNAVAILABLE until a worker holds it).
    if not name or name in entry.adapters or name in entry.adapter_names():
        return
    if entry.refresh is not None:
        await entry.refresh()
        if name in entry.adapter_names():
            return
    raise AdapterNotFound(entry.name, name, entry.adapter_names())
