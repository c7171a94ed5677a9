"""Whether a generated output satisfies its constraint, judged two ways.

- By the text, independently of any engine: a finished JSON output parses (and validates
  against its schema with `jsonschema`), a regex output matches in full, a choice is one
  of the choices, a grammar output matches the grammar's equivalent regular expression.
- By the tokens, with xgrammar's own matcher over the model's tokenizer (compiled as vLLM
  compiles it for these engine settings: no whitespace in JSON): every token is one the
  constraint allows where it stands, and a stream that ended with STOP ended where the
  constraint may end. This also judges outputs that max_tokens cut short, which no text
  check can: a valid prefix is all they owe.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
from switchyard.v1 import common_pb2


@dataclass(frozen=True)
class Case:
    """One constraint, as the request carries it and as the text is checked."""

    kind: str
    value: Any  # the schema (a dict), True, a regex, a list of choices, or a grammar
    text_pattern: str = ""  # a grammar's equivalent regex, for the text check

    def to_proto(self) -> common_pb2.OutputConstraint:
        msg = common_pb2.OutputConstraint()
        if self.kind == "json_schema":
            msg.json_schema = json.dumps(self.value)
        elif self.kind == "json_object":
            msg.json_object = True
        elif self.kind == "choice":
            msg.choice.values.extend(self.value)
        else:
            setattr(msg, self.kind, self.value)
        return msg


# Outputs of tens of tokens on the tiny model, so that a kill lands inside them.
CASES = (
    Case(
        "json_schema",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 999999},
                "name": {"enum": ["alpha", "bravo", "charlie"]},
                "tags": {
                    "type": "array",
                    "items": {"enum": ["red", "green", "blue"]},
                    "minItems": 3,
                    "maxItems": 6,
                },
                "ok": {"type": "boolean"},
            },
            "required": ["id", "name", "tags", "ok"],
            "additionalProperties": False,
        },
    ),
    Case("json_object", True),
    Case("regex", r"[a-z]{10,30}( [a-z]{3,8}){4,8}\."),
    Case(
        "choice",
        [
            "the quick brown fox jumps over the lazy dog",
            "switch the trains at the yard before midnight",
            "every stream completes after a worker dies",
        ],
    ),
    Case(
        "grammar",
        'root ::= "route " [0-9]{6,12} ("-" [a-z]{3,6}){3,6}',
        text_pattern=r"route [0-9]{6,12}(-[a-z]{3,6}){3,6}",
    ),
)


class Checker:
    """Judges outputs of the model at `model_dir` (its tokenizer)."""

    def __init__(self, model_dir: Path) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self._xgr = xgr
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
        self._compiled: dict[str, Any] = {}

    def _grammar(self, case: Case) -> Any:
        key = f"{case.kind}:{case.value!r}"
        if key not in self._compiled:
            c = self._compiler
            compact = {"any_whitespace": False, "separators": (",", ":")}
            if case.kind == "json_schema":
                g = c.compile_json_schema(json.dumps(case.value), **compact)
            elif case.kind == "json_object":
                g = c.compile_json_schema('{"type": "object"}', **compact)
            elif case.kind == "regex":
                g = c.compile_regex(case.value)
            elif case.kind == "choice":
                g = c.compile_regex("|".join(_literal(v) for v in case.value))
            else:
                g = c.compile_grammar(case.value)
            self._compiled[key] = g
        return self._compiled[key]

    def violation(self, case: Case, text: str, token_ids: list[int], stopped: bool) -> str | None:
        """Why the output breaks its constraint; None when it keeps it."""
        matcher = self._xgr.GrammarMatcher(self._grammar(case))
        for i, token in enumerate(token_ids):
            if matcher.is_terminated():
                return f"token {i} ({token}) comes after the constraint was complete"
            if not matcher.accept_token(token):
                return f"token {i} ({token}) is not allowed there: {text!r}"
        if not stopped:
            return None  # cut short by max_tokens: a valid prefix
        if not matcher.is_terminated():
            return f"it stopped where the constraint cannot end: {text!r}"
        return _text_violation(case, text)


def _literal(text: str) -> str:
    """`text` as a regex that matches it literally (re.escape would also escape spaces,
    which xgrammar's regex reader warns about)."""
    return "".join("\\" + ch if ch in "\\^$.|?*+()[]{}" else ch for ch in text)


def _text_violation(case: Case, text: str) -> str | None:
    if case.kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return f"not JSON ({e}): {text!r}"
        if case.kind == "json_object" and not isinstance(value, dict):
            return f"not an object: {text!r}"
        if case.kind == "json_schema":
            try:
                jsonschema.validate(value, case.value)
            except jsonschema.ValidationError as e:
                return f"not valid against the schema ({e.message}): {text!r}"
        return None
    if case.kind == "choice":
        return None if text in case.value else f"not one of the choices: {text!r}"
    pattern = case.text_pattern or case.value
    return None if re.fullmatch(pattern, text) else f"does not match {pattern!r}: {text!r}"
