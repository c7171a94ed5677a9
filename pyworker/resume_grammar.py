"""Structured output that continues mid-output: a resumed request's constraint, with its
grammar advanced past the tokens that another worker generated before it failed.

vLLM's structured-output backends compile a request's grammar and start it at the
request's first output token, and have no way to start it further on. A resumed
request's output began on another worker, so here its grammar would start again inside
the output (a new JSON object inside the first one's string). This module gives such a
request the grammar vLLM would have had by now:

- `ResumedConstraint` is a vLLM logits processor (loaded into the engine core through
  `logits_processors`) that acts only on requests whose `SamplingParams.extra_args` carry
  `RESUME_ARG`: it compiles the constraint with the backend vLLM itself uses (the same
  classes and the engine's `structured_outputs_config`), feeds it the tokens so far, then
  each step masks the request's logits with the grammar's bitmask and advances the grammar
  by the token sampled, as vLLM's own structured output does. Every other request passes
  through untouched.
- `ResumeGrammars` does the same compile-and-advance in the worker's own process before
  the request reaches the engine, so that a constraint that cannot continue from those
  tokens is refused up front (FAILED_PRECONDITION) instead of going unconstrained.

Backends: vLLM's `xgrammar` and `guidance`, and `auto` choosing between them as vLLM does
(xgrammar unless the constraint uses what it lacks). With `outlines` or
`lm-format-enforcer`, or with speculative decoding (vLLM takes no logits processor
then), the worker declares no resumable kinds and the control plane does not resume
constrained streams on it.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# The SamplingParams.extra_args key of a resumed constrained request:
# {"constraint": {<StructuredOutputsParams field>: value}, "output": [token ids so far]}.
RESUME_ARG = "switchyard_resume"
# The processor, as vLLM's `logits_processors` engine argument names it.
PROCESSOR = f"{__name__}:ResumedConstraint"
BACKENDS = ("auto", "xgrammar", "guidance")


class CannotResume(ValueError):
    """The constraint cannot be continued from the tokens so far (a ValueError: vLLM
    turns it into a client error should the engine's own check raise it)."""


@dataclass(frozen=True, slots=True)
class ResumeSpec:
    """What a resumed constrained request carries to the engine."""

    constraint: Mapping[str, Any]  # one StructuredOutputsParams field and its value
    output: tuple[int, ...]  # the tokens the output already has

    def to_extra_args(self) -> dict[str, Any]:
        return {RESUME_ARG: {"constraint": dict(self.constraint), "output": list(self.output)}}

    @classmethod
    def of(cls, params: Any) -> ResumeSpec | None:
        """The spec a SamplingParams carries; None when it carries none. Raises
        CannotResume when it is malformed."""
        extra = getattr(params, "extra_args", None) or {}
        raw = extra.get(RESUME_ARG)
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise CannotResume(f"extra_args[{RESUME_ARG!r}] must be a mapping")
        constraint = raw.get("constraint")
        output = raw.get("output")
        if not isinstance(constraint, Mapping) or len(constraint) != 1:
            raise CannotResume(f"extra_args[{RESUME_ARG!r}].constraint must have one field")
        if not isinstance(output, Sequence) or not all(
            isinstance(t, int) and t >= 0 for t in output
        ):
            raise CannotResume(f"extra_args[{RESUME_ARG!r}].output must be token ids")
        return cls(constraint=dict(constraint), output=tuple(output))


def resumable(engine_kwargs: Mapping[str, Any]) -> bool:
    """Whether an engine built with these AsyncEngineArgs can continue constrained
    requests: a tokenizer, a backend this module drives, and no speculative decoding
    (vLLM takes no logits processor with it)."""
    if engine_kwargs.get("skip_tokenizer_init") or engine_kwargs.get("speculative_config"):
        return False
    config = engine_kwargs.get("structured_outputs_config")
    backend = config.get("backend") if isinstance(config, Mapping) else None
    if config is not None and not isinstance(config, Mapping):
        backend = getattr(config, "backend", None)
    return str(backend or "auto") in BACKENDS


def resume_backend(vllm_config: Any) -> str:
    """The structured-output backend the engine was configured with (`auto` by default)."""
    config = getattr(vllm_config, "structured_outputs_config", None)
    return str(getattr(config, "backend", "auto") or "auto")


class ResumeGrammars:
    """Compiles a constraint with vLLM's own backend classes and advances it past the
    output so far. Each backend is built once, on first use (it indexes the vocabulary)."""

    def __init__(self, vllm_config: Any, tokenizer: Any = None) -> None:
        self._config = vllm_config
        self._tokenizer = tokenizer
        self._backends: dict[str, Any] = {}
        self._lock = threading.Lock()  # the worker checks in threads; building is slow

    def primed(self, spec: ResumeSpec, stop_token_ids: Iterable[int] = ()) -> Any:
        """A vLLM StructuredOutputGrammar that has accepted `spec.output`; where vLLM's
        backend takes them (0.32), `stop_token_ids` end it as they would vLLM's own.
        Raises CannotResume naming why not, whatever went wrong."""
        try:
            return self._primed(spec, frozenset(stop_token_ids))
        except CannotResume:
            raise
        except Exception as exc:  # a backend that would not build: never the engine's end
            raise CannotResume(f"{type(exc).__name__}: {exc}") from exc

    def _primed(self, spec: ResumeSpec, stop_token_ids: frozenset[int]) -> Any:
        from vllm.sampling_params import SamplingParams, StructuredOutputsParams
        from vllm.v1.structured_output.request import get_structured_output_key

        try:
            params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec.constraint))
        except Exception as exc:
            raise CannotResume(f"vLLM refuses the constraint: {exc}") from exc
        name = self._choose(params)
        key = get_structured_output_key(params.structured_outputs)
        backend = self._backend(name)
        try:
            if (
                stop_token_ids
                and "stop_token_ids" in inspect.signature(backend.compile_grammar).parameters
            ):
                grammar = backend.compile_grammar(*key, stop_token_ids=set(stop_token_ids))
            else:
                grammar = backend.compile_grammar(*key)
        except Exception as exc:
            raise CannotResume(f"the {name} backend cannot compile the constraint: {exc}") from exc
        for i, token in enumerate(spec.output):
            if grammar.is_terminated():
                raise CannotResume(
                    f"the constraint was already complete after {i} of the "
                    f"{len(spec.output)} tokens so far"
                )
            if not grammar.accept_tokens("resume", [token]):
                raise CannotResume(
                    f"token {i} of the output so far (id {token}) does not satisfy the constraint"
                )
        return grammar

    def _choose(self, params: Any) -> str:
        """The backend vLLM would pick for these params (normalising them as its own
        check does: xgrammar takes choices as a grammar)."""
        from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar
        from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

        setting = resume_backend(self._config)
        if setting not in BACKENDS:
            raise CannotResume(f"the {setting} structured-output backend cannot resume")
        if setting in ("auto", "xgrammar"):
            try:
                validate_xgrammar_grammar(params)
                return "xgrammar"
            except ValueError as exc:
                if setting == "xgrammar":
                    raise CannotResume(f"xgrammar refuses the constraint: {exc}") from exc
        try:
            validate_guidance_grammar(params)
        except ValueError as exc:
            raise CannotResume(f"guidance refuses the constraint: {exc}") from exc
        return "guidance"

    def _backend(self, name: str) -> Any:
        with self._lock:
            backend = self._backends.get(name)
            if backend is not None:
                return backend
            if self._tokenizer is None:
                from vllm.tokenizers import cached_tokenizer_from_config

                self._tokenizer = cached_tokenizer_from_config(
                    model_config=self._config.model_config
                )
            if name == "xgrammar":
                from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend as cls
            else:
                from vllm.v1.structured_output.backend_guidance import GuidanceBackend as cls
            backend = cls(
                self._config,
                tokenizer=self._tokenizer,
                vocab_size=self._config.model_config.get_vocab_size(),
            )
            self._backends[name] = backend
            log.info("resume grammar backend ready", backend=name)
            return backend


class _Masked:
    """One resumed request's step function: advance by the tokens sampled since the last
    step, then leave only what the grammar allows."""

    def __init__(self, grammar: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._grammar = grammar
        self._seen = 0  # of vLLM's output tokens (the primed ones are in the prompt)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._broken = False

    def __call__(self, output_ids: list[int], logits: Any) -> Any:
        import torch
        import xgrammar as xgr

        while self._seen < len(output_ids) and not self._broken:
            token = output_ids[self._seen]
            if token < 0:  # a placeholder of asynchronous scheduling: known next step
                break
            if not self._grammar.accept_tokens("resume", [token]):
                self._broken = True
                log.error("resumed request sampled a token its grammar refuses", token=token)
            self._seen += 1
        if self._broken or self._grammar.is_terminated():
            return logits
        self._grammar.fill_bitmask(self._bitmask, 0)
        row = logits.unsqueeze(0)
        if row.is_cpu and row.dtype != torch.float32:
            as_float = row.to(torch.float32)
            xgr.apply_token_bitmask_inplace(as_float, self._bitmask)
            row.copy_(as_float.to(row.dtype))
        else:
            xgr.apply_token_bitmask_inplace(row, self._bitmask.to(row.device))
        return logits


def _processor_class() -> type:
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ResumedConstraintProcessor(AdapterLogitsProcessor):  # type: ignore[misc]
        """The grammar of each resumed constrained request, advanced past its output so
        far, applied to its logits every step. Loaded by vLLM in every engine process
        that samples."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            super().__init__(vllm_config, device, is_pin_memory)
            self._grammars = ResumeGrammars(vllm_config)
            self._vocab_size = int(vllm_config.model_config.get_vocab_size())

        def is_argmax_invariant(self) -> bool:
            return False  # it changes which token is likeliest

        @classmethod
        def validate_params(cls, sampling_params: Any) -> None:
            ResumeSpec.of(sampling_params)  # the shape; the worker compiled it already

        def new_req_logits_processor(self, params: Any) -> Any:
            spec = ResumeSpec.of(params)
            if spec is None:
                return None
            stops = _stop_ids(params)
            try:
                grammar = self._grammars.primed(spec, stops)
            except CannotResume:
                # The worker compiled and advanced the same grammar before sending the
                # request, so this does not happen; if it did, end the output now (the
                # worker's ResumeGuard then fails the request: never an OK broken output).
                log.exception("resumed request's grammar failed in the engine")
                return _end_now(sorted(stops))
            return _Masked(grammar, self._vocab_size)

    ResumedConstraintProcessor.__name__ = "ResumedConstraint"
    ResumedConstraintProcessor.__qualname__ = "ResumedConstraint"
    return ResumedConstraintProcessor


def _stop_ids(params: Any) -> frozenset[int]:
    """The request's EOS and stop token ids, as vLLM gives them to its own grammars."""
    return frozenset(int(t) for t in getattr(params, "all_stop_token_ids", None) or ())


class ResumeGuard:
    """The worker's own check of a resumed constrained request's output: the grammar it
    primed before sending the request, advanced by every token the engine returns. Should
    the engine ever let a token through that the constraint forbids, or stop where the
    constraint cannot end, the request ends with an error instead of an OK answer."""

    def __init__(self, grammar: Any) -> None:
        self._grammar = grammar
        self.broken: str | None = None
        self._seen = 0

    def feed(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            if self.broken is None and not self._grammar.is_terminated():
                if not self._grammar.accept_tokens("guard", [int(token)]):
                    self.broken = (
                        f"the engine produced token {token} after {self._seen} new "
                        "tokens, where the constraint does not allow it"
                    )
            self._seen += 1

    def check_end(self, stopped: bool) -> str | None:
        """Why the output so far breaks its constraint for an ending of this kind (a
        length or time limit owes a valid start only); None when it keeps it."""
        if self.broken is not None:
            return self.broken
        if stopped and not self._grammar.is_terminated():
            return "the output stopped where its constraint cannot end"
        return None


def _end_now(stop_ids: list[int]) -> Any:
    def only_stop(output_ids: list[int], logits: Any) -> Any:
        import torch

        keep = logits.clone()
        logits.fill_(-float("inf"))
        if stop_ids:
            index = torch.tensor(stop_ids, device=logits.device)
            logits[index] = keep[index]
        return logits

    return only_stop


def __getattr__(name: str) -> Any:
    """`ResumedConstraint`, built on first access: vLLM is imported only by the processes
    that load it (the engine's), not by whatever imports this module."""
    if name == "ResumedConstraint":
        cls = _processor_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
