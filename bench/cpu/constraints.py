"""Whether a generated output satisfies its constraint, judged two ways.

- By the text, independently of any engine: a finished JSON output parses (and validates
  against its schema with `jsonschema`), a regex output matches in full, a choice is one
  of the choices, a grammar output matches the grammar's equivalent regular expression.
- By the tokens, with xgrammar's own matcher over the model's tokenizer (compiled as vLLM
  compiles it, with or without whitespace in JSON as the engine's setting says): every
  token is one the
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

from control.text.constraints import Constraint


@dataclass(frozen=True)
class Case:
    """One constraint, as the request carries it and as the text is checked."""

    kind: str
    value: Any  # the schema (a dict), True, a regex, a list of choices, or a grammar
    text_pattern: str = ""  # a grammar's equivalent regex, for the text check

    def to_proto(self) -> common_pb2.OutputConstraint:
        if self.kind == "choice":
            return Constraint(self.kind, choices=tuple(self.value)).to_proto()
        text = json.dumps(self.value) if self.kind == "json_schema" else self.value
        return Constraint(self.kind, text=text if isinstance(text, str) else "").to_proto()


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

    def __init__(self, model_dir: Path, any_whitespace: bool = False) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self._xgr = xgr
        self._any_whitespace = any_whitespace
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
        self._compiled: dict[str, list[Any]] = {}

    def _grammars(self, case: Case) -> list[Any]:
        """The constraint compiled as vLLM compiles it. Compact JSON comes in two styles:
        vLLM 0.32 separates with "," and ":", 0.26 (xgrammar's default) with ", " and
        ": "; an output may follow either."""
        key = f"{case.kind}:{case.value!r}"
        if key not in self._compiled:
            c = self._compiler
            if case.kind in ("json_schema", "json_object"):
                schema = (
                    json.dumps(case.value) if case.kind == "json_schema" else '{"type": "object"}'
                )
                if self._any_whitespace:
                    styles: list[dict[str, Any]] = [{"any_whitespace": True}]
                else:
                    styles = [
                        {"any_whitespace": False, "separators": (",", ":")},
                        {"any_whitespace": False},
                    ]
                grammars = [c.compile_json_schema(schema, **style) for style in styles]
            elif case.kind == "regex":
                grammars = [c.compile_regex(case.value)]
            elif case.kind == "choice":
                grammars = [c.compile_regex("|".join(_literal(v) for v in case.value))]
            else:
                grammars = [c.compile_grammar(case.value)]
            self._compiled[key] = grammars
        return self._compiled[key]

    def violation(self, case: Case, text: str, token_ids: list[int], stopped: bool) -> str | None:
        """Why the output breaks its constraint; None when it keeps it."""
        whys = [self._by_tokens(g, text, token_ids, stopped) for g in self._grammars(case)]
        if all(why is not None for why in whys):
            return whys[0]
        return _text_violation(case, text) if stopped else None

    def _by_tokens(
        self, grammar: Any, text: str, token_ids: list[int], stopped: bool
    ) -> str | None:
        matcher = self._xgr.GrammarMatcher(grammar)
        for i, token in enumerate(token_ids):
            if matcher.is_terminated():
                return f"token {i} ({token}) comes after the constraint was complete"
            if not matcher.accept_token(token):
                return f"token {i} ({token}) is not allowed there: {text!r}"
        if stopped and not matcher.is_terminated():
            return f"it stopped where the constraint cannot end: {text!r}"
        return None  # a valid whole, or (cut short by max_tokens) a valid start


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
