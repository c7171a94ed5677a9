"""The edge: a raw `GenerateRequest` becomes a validated `GenerationParams`, or an
`InvalidArgument` whose violations name each bad field by its path in the request.

Validation happens in two steps. `parse_request` checks everything that needs no model
(ranges, shapes); `ModelLimits.bind` checks what depends on the model (vocabulary,
context) once the prompt is tokenized, and settles `max_tokens`.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass

from switchyard.v1 import common_pb2, generation_pb2

from control.config import MAX_STREAM_INTERVAL
from control.errors import FieldViolation, InvalidArgument
from control.text.constraints import Constraint, parse_constraint
from switchyard_common.names import ADAPTER_NAME, ADAPTER_NAME_RULE

# Limits on what one request may ask for, checked before any work is done
# (docs/api.md, "Limits and errors").
MAX_PROMPT_CHARS = 1_000_000  # prompt text; longer prompts cannot fit any served context
MAX_PROMPT_TOKEN_IDS = 1_000_000  # prompt token ids
MAX_CHAT_MESSAGES = 4096  # turns of a chat prompt (their text counts toward MAX_PROMPT_CHARS)
MAX_ROLE_CHARS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_REQUEST_ID = 128
MAX_SAMPLES = 16  # n: samples of one prompt, fanned out by the control plane
MAX_BEAM_WIDTH = 16  # beams of one beam search (the engine's own limit may be lower)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None

    def to_proto(self) -> common_pb2.SamplingParams:
        """The settings given (None: the engine's default), as the workers take them."""
        out = common_pb2.SamplingParams()
        for name in SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                setattr(out, name, value)
        return out


# The sampling settings, as the API defines them: `Sampling` holds exactly these.
SAMPLING_FIELDS = tuple(f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields)
if SAMPLING_FIELDS != tuple(f.name for f in dataclasses.fields(Sampling)):
    raise ImportError(f"Sampling's fields differ from SamplingParams': {SAMPLING_FIELDS}")


@dataclass(frozen=True, slots=True)
class GenerationParams:
    model: str
    request_id: str
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    sampling: Sampling
    max_tokens: int | None
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    include_stop: bool
    logprobs: int | None
    skip_special_tokens: bool
    priority: int
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) of a chat prompt
    constraint: Constraint | None = None  # structured output
    prompt_logprobs: int | None = None  # top-n for each prompt token, in the first chunk
    n: int = 1  # samples of this prompt
    adapter: str = ""  # the LoRA adapter's name; "" for the base model
    beam_width: int = 1  # beam search with this many beams when > 1
    stream_interval: int = 0  # tokens per streamed chunk; 0: the server's default

    @property
    def prompt_field(self) -> str:
        if self.messages is not None:
            return "messages"
        return "text" if self.prompt_text is not None else "token_ids.ids"


@dataclass(frozen=True, slots=True)
class ModelLimits:
    max_context: int
    vocab_size: int

    def bind(self, params: GenerationParams, prompt_ids: list[int]) -> int:
        """Check the tokenized prompt and stop ids against the model; return max_tokens."""
        violations: list[FieldViolation] = []
        field = params.prompt_field
        if not prompt_ids:
            violations.append(FieldViolation(field, "the prompt is empty after tokenization"))
        if len(prompt_ids) >= self.max_context:
            violations.append(
                FieldViolation(
                    field,
                    f"the prompt has {len(prompt_ids)} tokens; the model's context is "
                    f"{self.max_context} tokens, and at least one must be left to generate",
                )
            )
        if params.prompt_ids is not None:
            for i, t in enumerate(prompt_ids):
                if t >= self.vocab_size:
                    violations.append(
                        FieldViolation(
                            f"token_ids.ids[{i}]",
                            f"token id {t} is outside the vocabulary (size {self.vocab_size})",
                        )
                    )
                    break
        for i, t in enumerate(params.stop_token_ids):
            if t >= self.vocab_size:
                violations.append(
                    FieldViolation(
                        f"stopping.stop_token_ids[{i}]",
                        f"token id {t} is outside the vocabulary (size {self.vocab_size})",
                    )
                )
        room = self.max_context - len(prompt_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if params.max_tokens is not None and room > 0 and params.max_tokens > room:
            violations.append(
                FieldViolation(
                    "stopping.max_tokens",
                    f"{params.max_tokens} tokens do not fit: the prompt has {len(prompt_ids)} "
                    f"tokens and the model's context is {self.max_context}, leaving {room}",
                )
            )
        if violations:
            raise InvalidArgument(violations)
        return max_tokens


def check_prompt_text(field: str, text: str) -> FieldViolation | None:
    """A prompt text's length, checked before anything encodes it."""
    if len(text) > MAX_PROMPT_CHARS:
        return FieldViolation(field, f"longer than {MAX_PROMPT_CHARS} characters ({len(text)})")
    return None


def parse_request(req: generation_pb2.GenerateRequest) -> GenerationParams:
    v: list[FieldViolation] = []
    if not req.model:
        v.append(FieldViolation("model", "required: the name of a served model"))

    which = req.WhichOneof("prompt")
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    if which is None:
        v.append(FieldViolation("prompt", "required: set text, token_ids or messages"))
    elif which == "messages":
        messages = _parse_messages(req, v)
    elif which == "text":
        prompt_text = req.text
        if not prompt_text:
            v.append(FieldViolation("text", "the prompt text is empty"))
        elif (too_long := check_prompt_text("text", prompt_text)) is not None:
            v.append(too_long)
            prompt_text = ""
    else:
        count = len(req.token_ids.ids)
        if not count:
            v.append(FieldViolation("token_ids.ids", "the prompt has no token ids"))
        elif count > MAX_PROMPT_TOKEN_IDS:
            v.append(
                FieldViolation("token_ids.ids", f"more than {MAX_PROMPT_TOKEN_IDS} ids ({count})")
            )
        else:
            prompt_ids = tuple(req.token_ids.ids)

    sampling = _parse_sampling(req, v)

    st = req.stopping
    max_tokens = st.max_tokens if st.HasField("max_tokens") else None
    if max_tokens is not None and max_tokens < 1:
        v.append(FieldViolation("stopping.max_tokens", "must be at least 1 when set"))
    min_tokens = st.min_tokens if st.HasField("min_tokens") else 0
    if max_tokens is not None and min_tokens > max_tokens:
        v.append(
            FieldViolation(
                "stopping.min_tokens", f"{min_tokens} is more than max_tokens ({max_tokens})"
            )
        )
    stop = tuple(st.stop)
    if len(stop) > MAX_STOP_STRINGS:
        v.append(FieldViolation("stopping.stop", f"at most {MAX_STOP_STRINGS} stop strings"))
        stop = stop[:MAX_STOP_STRINGS]  # name the first bad ones, not thousands
    for i, s in enumerate(stop):
        if not s:
            v.append(FieldViolation(f"stopping.stop[{i}]", "a stop string cannot be empty"))
        elif len(s) > MAX_STOP_LENGTH:
            v.append(
                FieldViolation(f"stopping.stop[{i}]", f"longer than {MAX_STOP_LENGTH} characters")
            )

    if len(st.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        v.append(
            FieldViolation(
                "stopping.stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids ({len(st.stop_token_ids)})",
            )
        )

    out = req.output
    logprobs = out.logprobs if out.HasField("logprobs") else None
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        v.append(FieldViolation("output.logprobs", f"at most {MAX_LOGPROBS}, got {logprobs}"))
    prompt_logprobs = out.prompt_logprobs if out.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and prompt_logprobs > MAX_LOGPROBS:
        v.append(
            FieldViolation(
                "output.prompt_logprobs", f"at most {MAX_LOGPROBS}, got {prompt_logprobs}"
            )
        )

    stream_interval = out.stream_interval if out.HasField("stream_interval") else 0
    if stream_interval > MAX_STREAM_INTERVAL:
        v.append(
            FieldViolation(
                "output.stream_interval",
                f"at most {MAX_STREAM_INTERVAL} tokens per chunk, got {stream_interval}",
            )
        )

    constraint = parse_constraint(req.constraint, v) if req.HasField("constraint") else None

    n = req.n or 1
    if n > MAX_SAMPLES:
        v.append(FieldViolation("n", f"at most {MAX_SAMPLES} samples, got {n}"))

    if req.adapter and not ADAPTER_NAME.fullmatch(req.adapter):
        v.append(FieldViolation("adapter", ADAPTER_NAME_RULE))

    beam_width = req.beam_width or 1
    if beam_width > 1:
        _check_beam(req, sampling, beam_width, v)

    request_id = req.request_id
    if len(request_id) > MAX_REQUEST_ID or not request_id.isprintable():
        v.append(FieldViolation("request_id", f"at most {MAX_REQUEST_ID} printable characters"))
    if v:
        raise InvalidArgument(v)
    return GenerationParams(
        model=req.model,
        request_id=request_id or uuid.uuid4().hex,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        sampling=sampling,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop,
        stop_token_ids=tuple(st.stop_token_ids),
        ignore_eos=st.ignore_eos,
        include_stop=st.include_stop_str_in_output,
        logprobs=logprobs,
        skip_special_tokens=out.skip_special_tokens
        if out.HasField("skip_special_tokens")
        else True,
        priority=req.priority,
        messages=messages,
        constraint=constraint,
        prompt_logprobs=prompt_logprobs,
        n=n,
        adapter=req.adapter,
        beam_width=beam_width,
        stream_interval=stream_interval,
    )


def _check_beam(
    req: generation_pb2.GenerateRequest,
    sampling: Sampling,
    beam_width: int,
    v: list[FieldViolation],
) -> None:
    """What beam search does not take, the same on every engine: it ranks beams by the
    model's own log probabilities and ends a beam at the EOS only."""
    if beam_width > MAX_BEAM_WIDTH:
        v.append(FieldViolation("beam_width", f"at most {MAX_BEAM_WIDTH} beams, got {beam_width}"))
    why = "not with beam search (beam_width > 1)"
    for name in Sampling.__slots__:
        value = getattr(sampling, name)
        if value is not None and not (name == "temperature" and value == 0):
            v.append(
                FieldViolation(
                    f"sampling.{name}",
                    f"{why}: it ranks beams by the model's own log probabilities",
                )
            )
    st, out = req.stopping, req.output
    if req.n > 1:
        v.append(FieldViolation("n", f"{why}: the beams are the answer's choices"))
    taken = [
        (f"constraint.{req.constraint.WhichOneof('kind')}", req.HasField("constraint")),
        ("output.logprobs", out.HasField("logprobs")),
        ("output.prompt_logprobs", out.HasField("prompt_logprobs")),
        ("stopping.stop", bool(st.stop)),
        ("stopping.stop_token_ids", bool(st.stop_token_ids)),
        ("stopping.min_tokens", st.min_tokens > 0),
    ]
    v.extend(FieldViolation(field, why) for field, present in taken if present)


def _parse_messages(
    req: generation_pb2.GenerateRequest, v: list[FieldViolation]
) -> tuple[tuple[str, str], ...] | None:
    turns = req.messages.messages
    if not turns:
        v.append(FieldViolation("messages.messages", "the conversation has no messages"))
        return None
    if len(turns) > MAX_CHAT_MESSAGES:
        v.append(
            FieldViolation("messages.messages", f"more than {MAX_CHAT_MESSAGES} ({len(turns)})")
        )
        return None
    total = 0
    for i, m in enumerate(turns):
        if not m.role or len(m.role) > MAX_ROLE_CHARS or not m.role.isprintable():
            v.append(
                FieldViolation(
                    f"messages.messages[{i}].role",
                    f"expected a role such as user or assistant (1 to {MAX_ROLE_CHARS} "
                    "printable characters)",
                )
            )
        total += len(m.content)
    if total > MAX_PROMPT_CHARS:
        v.append(FieldViolation("messages.messages", f"longer than {MAX_PROMPT_CHARS} characters"))
    return tuple((m.role, m.content) for m in turns)


_FLOAT_RULES: tuple[tuple[str, float, float, bool, str], ...] = (
    # name, low, high, low is open, rule as the client reads it
    ("temperature", 0.0, math.inf, False, "must be >= 0"),
    ("top_p", 0.0, 1.0, True, "must be in (0, 1]"),
    ("min_p", 0.0, 1.0, False, "must be in [0, 1]"),
    ("repetition_penalty", 0.0, math.inf, True, "must be > 0 (1 is neutral)"),
    ("presence_penalty", -2.0, 2.0, False, "must be in [-2, 2]"),
    ("frequency_penalty", -2.0, 2.0, False, "must be in [-2, 2]"),
)


def _parse_sampling(req: generation_pb2.GenerateRequest, v: list[FieldViolation]) -> Sampling:
    s = req.sampling
    floats: dict[str, float | None] = {}
    for name, low, high, low_open, rule in _FLOAT_RULES:
        if not s.HasField(name):
            floats[name] = None
            continue
        value = float(getattr(s, name))
        above = value > low if low_open else value >= low
        if math.isnan(value) or not above or value > high or math.isinf(value):
            v.append(FieldViolation(f"sampling.{name}", f"{rule}, got {value:g}"))
        floats[name] = value
    top_k: int | None = None
    if s.HasField("top_k"):
        top_k = s.top_k
        if top_k < -1:
            v.append(FieldViolation("sampling.top_k", f"must be -1, 0 or >= 1, got {top_k}"))
    return Sampling(top_k=top_k, seed=s.seed if s.HasField("seed") else None, **floats)
