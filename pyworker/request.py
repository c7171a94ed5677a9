"""Parse a worker GenerateRequest into what the engine needs, or say which field is wrong.

Only what the worker can judge is checked here: the prompt against the model's vocabulary
and context, and sampling values against their documented ranges. Unset optional fields
keep vLLM's defaults.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyworker.engine import EngineInfo
from pyworker.errors import FailedPrecondition, FieldViolation, InvalidArgument
from pyworker.resume_grammar import ResumeSpec
from switchyard_common.deadlines import budget

_MAX_TEMPERATURE = 2.0  # vLLM rejects anything hotter


def deadline_after(remaining_s: float) -> float:
    """The monotonic time to give up on a request with `remaining_s` left, keeping back
    the margin for the TIME_LIMIT final."""
    return time.monotonic() + max(budget(remaining_s), 0.0)


@dataclass(frozen=True)
class ParsedGenerate:
    """A validated generation request, ready for `AsyncLLM.generate`."""

    prompt_token_ids: list[int]
    sampling_params: Any  # vllm.SamplingParams
    logprobs: int | None
    priority: int
    stop_token_ids: frozenset[int]
    # The caller's W3C trace context ({"traceparent": ..., "tracestate": ...}), for the
    # engine's spans and this worker's log lines; None when it sent none.
    trace_headers: dict[str, str] | None = None
    # "constraint.<kind>" when the output is constrained: the field that vLLM's refusal of
    # the request at add time is about (its structured-output errors name none).
    constraint_field: str | None = None
    prompt_logprobs: int | None = None  # top-n for each prompt token, in the first chunk
    adapter: str = ""  # the LoRA adapter's name ("" for the base model)
    lora_request: Any = None  # its vllm LoRARequest, once admitted
    beam_width: int = 1  # beam search (pyworker/beams.py) when > 1
    # A resumed request: the tokens its output already has (from a worker that failed).
    # The engine continues after the prompt and these; usage counts neither as new.
    resume_token_ids: tuple[int, ...] = ()
    # A resumed constrained request: its grammar, to advance past those tokens.
    resume_spec: ResumeSpec | None = None
    # Tokens per chunk: the first at once, then at least this many, the rest at the end.
    stream_interval: int = 1

    @property
    def engine_prompt(self) -> list[int]:
        """What the engine is given: the prompt, then the output so far when resumed."""
        if not self.resume_token_ids:
            return self.prompt_token_ids
        return [*self.prompt_token_ids, *self.resume_token_ids]

    @property
    def trace_id(self) -> str | None:
        """The trace id of `traceparent` (version-traceid-spanid-flags)."""
        if not self.trace_headers:
            return None
        parts = self.trace_headers.get("traceparent", "").split("-")
        return parts[1] if len(parts) == 4 else None


def log_ids(request_id: str, parsed: ParsedGenerate) -> dict[str, str]:
    """What a request's log lines carry: its id, and the caller's trace id if any."""
    trace_id = parsed.trace_id
    if trace_id is None:
        return {"request_id": request_id}
    return {"request_id": request_id, "trace_id": trace_id}


def _trace_headers(request: Any) -> dict[str, str] | None:
    if not request.traceparent:
        return None
    headers = {"traceparent": str(request.traceparent)}
    if request.tracestate:
        headers["tracestate"] = str(request.tracestate)
    return headers


def parse_generate(request: Any, info: EngineInfo) -> ParsedGenerate:
    """Turn a `switchyard.worker.v1.GenerateRequest` into a `ParsedGenerate`.

    Raises `InvalidArgument` naming every offending field, and `FailedPrecondition` on
    `resume_token_ids` for a constrained resume this engine cannot continue.
    """
    violations: list[FieldViolation] = []
    prompt = list(request.prompt_token_ids)
    resume = [int(t) for t in request.resume_token_ids]
    _check_prompt(prompt, info, violations)
    _check_resume(resume, len(prompt), info, violations)
    _check_stopping(request, len(prompt) + len(resume), info, violations)
    logprobs: int | None = None
    if request.HasField("logprobs"):
        logprobs = int(request.logprobs)
        if logprobs > info.max_logprobs:
            violations.append(
                FieldViolation("logprobs", f"must be at most {info.max_logprobs}, got {logprobs}")
            )
    prompt_logprobs: int | None = None
    if request.HasField("prompt_logprobs"):
        prompt_logprobs = int(request.prompt_logprobs)
        if prompt_logprobs > info.max_logprobs:
            violations.append(
                FieldViolation(
                    "prompt_logprobs",
                    f"must be at most {info.max_logprobs}, got {prompt_logprobs}",
                )
            )
    sampling_kwargs = _sampling_kwargs(request.sampling, violations)
    constraint_field: str | None = None
    spec: ResumeSpec | None = None  # a constrained resume's grammar, to advance
    if request.HasField("constraint"):
        kind = request.constraint.WhichOneof("kind")
        if kind is None or kind not in info.structured_output:
            violations.append(
                FieldViolation(
                    f"constraint.{kind}" if kind else "constraint",
                    "this engine does not take that structured-output kind "
                    f"(it takes: {', '.join(info.structured_output) or 'none'})",
                )
            )
        elif resume:
            constraint_field = f"constraint.{kind}"
            if kind not in info.resumable_constraints:
                raise FailedPrecondition.for_field(
                    "resume_token_ids",
                    f"this engine cannot continue a {kind} constraint after another "
                    f"worker's tokens (it resumes: {_names(info.resumable_constraints)})",
                )
            spec = ResumeSpec(structured_output_fields(request.constraint, kind), tuple(resume))
            sampling_kwargs["extra_args"] = spec.to_extra_args()
        else:
            constraint_field = f"constraint.{kind}"
            sampling_kwargs.update(structured_output_kwargs(request.constraint, kind))
    beam_width = int(request.beam_width) or 1
    if beam_width > 1:
        _check_beam(request, beam_width, info, violations)
        sampling_kwargs["temperature"] = 0.0  # SamplingParams would take 1.0
    if violations:
        raise InvalidArgument(violations)

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    stop_token_ids = [int(t) for t in request.stop_token_ids]
    try:
        params = SamplingParams(
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,
            max_tokens=int(request.max_tokens),
            min_tokens=int(request.min_tokens),
            stop_token_ids=stop_token_ids,
            ignore_eos=bool(request.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **sampling_kwargs,
        )
    except Exception as exc:  # vLLM's own checks, should ours miss one
        field = getattr(exc, "parameter", None) or "sampling"
        raise InvalidArgument.for_field(str(field), str(exc)) from exc
    return ParsedGenerate(
        prompt_token_ids=prompt,
        sampling_params=params,
        logprobs=logprobs,
        priority=int(request.priority) if info.priority_scheduling else 0,
        stop_token_ids=frozenset(stop_token_ids),
        trace_headers=_trace_headers(request),
        constraint_field=constraint_field,
        prompt_logprobs=prompt_logprobs,
        adapter=str(request.adapter),
        beam_width=beam_width,
        resume_token_ids=tuple(resume),
        resume_spec=spec,
        stream_interval=max(1, int(request.stream_interval)),
    )


def _check_beam(request: Any, width: int, info: EngineInfo, out: list[FieldViolation]) -> None:
    """vLLM's beam search takes a width, max_tokens, ignore_eos and a temperature only;
    what else a request asks for is refused, not dropped."""
    if width > info.max_beam_width:
        most = info.max_beam_width
        out.append(
            FieldViolation(
                "beam_width",
                f"this engine searches at most {most} beams, got {width}"
                if most
                else "this engine has no beam search",
            )
        )
    s = request.sampling
    others = [f.name for f, _ in s.ListFields() if f.name != "temperature"]
    if s.HasField("temperature") and s.temperature != 0:
        others.insert(0, "temperature")  # it ranks by the model's own log probabilities
    asked = [
        *(f"sampling.{name}" for name in others),
        *(["stop_token_ids"] if request.stop_token_ids else []),
        *(["min_tokens"] if request.min_tokens else []),
        *(["logprobs"] if request.HasField("logprobs") else []),
        *(["prompt_logprobs"] if request.HasField("prompt_logprobs") else []),
        *(["constraint"] if request.HasField("constraint") else []),
        *(["resume_token_ids"] if request.resume_token_ids else []),
    ]
    out.extend(FieldViolation(name, "not with beam search (beam_width > 1)") for name in asked)


def structured_output_fields(constraint: Any, kind: str) -> dict[str, Any]:
    """An OutputConstraint as the one field of vLLM's structured-output params it sets."""
    value: Any
    if kind == "choice":
        value = list(constraint.choice.values)
    elif kind == "json_object":
        value = True
    else:
        value = str(getattr(constraint, kind))
    return {"json" if kind == "json_schema" else kind: value}


def structured_output_kwargs(constraint: Any, kind: str) -> dict[str, Any]:
    """The SamplingParams argument for an OutputConstraint: `structured_outputs=` a
    StructuredOutputsParams (vLLM 0.11 on, 0.26 and 0.32 alike), `guided_decoding=` a
    GuidedDecodingParams before that. The fields have the same names in both."""
    from vllm import sampling_params as sp

    fields = structured_output_fields(constraint, kind)
    params_cls = getattr(sp, "StructuredOutputsParams", None)
    if params_cls is not None:
        return {"structured_outputs": params_cls(**fields)}
    return {"guided_decoding": sp.GuidedDecodingParams(**fields)}


def _names(kinds: Sequence[str]) -> str:
    return ", ".join(kinds) or "none"


def _check_vocabulary(
    ids: Sequence[int], field: str, info: EngineInfo, out: list[FieldViolation]
) -> None:
    """The first id in `ids` outside the vocabulary, named as field[index]."""
    for index, token in enumerate(ids):
        if token >= info.vocab_size:
            out.append(
                FieldViolation(
                    f"{field}[{index}]",
                    f"token id {token} is outside the vocabulary (size {info.vocab_size})",
                )
            )
            return


def _check_prompt(prompt: list[int], info: EngineInfo, out: list[FieldViolation]) -> None:
    if not prompt:
        out.append(FieldViolation("prompt_token_ids", "must not be empty"))
        return
    _check_vocabulary(prompt, "prompt_token_ids", info, out)
    if len(prompt) >= info.max_context:
        out.append(
            FieldViolation(
                "prompt_token_ids",
                f"prompt of {len(prompt)} tokens leaves no room to generate within the "
                f"model's context of {info.max_context} tokens",
            )
        )


def _check_resume(
    resume: list[int], prompt_len: int, info: EngineInfo, out: list[FieldViolation]
) -> None:
    _check_vocabulary(resume, "resume_token_ids", info, out)
    if resume and 0 < prompt_len < info.max_context <= prompt_len + len(resume):
        out.append(
            FieldViolation(
                "resume_token_ids",
                f"the prompt ({prompt_len}) and the {len(resume)} tokens so far leave no "
                f"room to generate within the model's context of {info.max_context} tokens",
            )
        )


def _check_stopping(
    request: Any, prompt_len: int, info: EngineInfo, out: list[FieldViolation]
) -> None:
    max_tokens = int(request.max_tokens)
    if max_tokens < 1:
        out.append(FieldViolation("max_tokens", f"must be at least 1, got {max_tokens}"))
    elif 0 < prompt_len < info.max_context and prompt_len + max_tokens > info.max_context:
        out.append(
            FieldViolation(
                "max_tokens",
                f"prompt ({prompt_len}) plus max_tokens ({max_tokens}) exceeds the model's "
                f"context of {info.max_context} tokens",
            )
        )
    min_tokens = int(request.min_tokens)
    if max_tokens >= 1 and min_tokens > max_tokens:
        out.append(
            FieldViolation(
                "min_tokens", f"must not exceed max_tokens ({max_tokens}), got {min_tokens}"
            )
        )
    _check_vocabulary(request.stop_token_ids, "stop_token_ids", info, out)


def _sampling_kwargs(sampling: Any, out: list[FieldViolation]) -> dict[str, Any]:
    """SamplingParams keyword arguments for the fields that are set and valid."""
    kwargs: dict[str, Any] = {}

    def get(name: str) -> Any:
        return getattr(sampling, name) if sampling.HasField(name) else None

    def check_float(name: str, low: float, high: float, *, low_open: bool = False) -> None:
        value = get(name)
        if value is None:
            return
        value = float(value)
        ok = math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
        if not ok:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            out.append(FieldViolation(f"sampling.{name}", f"must be in {interval}, got {value:g}"))
            return
        kwargs[name] = value

    check_float("temperature", 0.0, _MAX_TEMPERATURE)
    check_float("top_p", 0.0, 1.0, low_open=True)
    check_float("min_p", 0.0, 1.0)
    check_float("repetition_penalty", 0.0, math.inf, low_open=True)
    check_float("presence_penalty", -2.0, 2.0)
    check_float("frequency_penalty", -2.0, 2.0)

    top_k = get("top_k")
    if top_k is not None:
        if top_k < -1:
            out.append(
                FieldViolation("sampling.top_k", f"must be 0 or -1 (disabled) or >= 1, got {top_k}")
            )
        else:
            kwargs["top_k"] = 0 if top_k == -1 else int(top_k)
    seed = get("seed")
    if seed is not None:
        kwargs["seed"] = int(seed)
    return kwargs
