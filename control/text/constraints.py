"""Structured output at the edge: a request's `OutputConstraint` becomes a validated
`Constraint`, or field violations that name what is wrong with it.

What can be checked without the engine is checked here, the same for every engine: a JSON
schema parses and is a valid schema (`jsonschema`'s own metaschema check), a regular
expression compiles, choices are there, sizes are bounded. A grammar's syntax is the
engine's to judge (EBNF or Lark, as its backend reads it); the worker names the field when
the engine refuses it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
from switchyard.v1 import common_pb2

from control.errors import FieldViolation

MAX_CONSTRAINT_CHARS = 256 * 1024  # a schema, regex or grammar; all choices together
MAX_CHOICES = 1024
# The kinds, named as the oneof's fields and as Capabilities.structured_output lists them.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # one of KINDS
    text: str = ""  # the schema (as JSON text), regex or grammar
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """Its path in the public request, for errors."""
        return f"constraint.{self.kind}"

    def to_proto(self) -> common_pb2.OutputConstraint:
        msg = common_pb2.OutputConstraint()
        if self.kind == "json_object":
            msg.json_object = True
        elif self.kind == "choice":
            msg.choice.values.extend(self.choices)
        else:
            setattr(msg, self.kind, self.text)
        return msg


def parse_constraint(
    msg: common_pb2.OutputConstraint, v: list[FieldViolation]
) -> Constraint | None:
    """The constraint of a request whose `constraint` field is set; None (with violations
    added to `v`) when it is not valid."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        v.append(FieldViolation("constraint", f"set one of {', '.join(KINDS)} (or leave it unset)"))
        return None
    field = f"constraint.{kind}"
    if kind == "json_object":
        if not msg.json_object:
            v.append(
                FieldViolation(field, "must be true; leave the constraint unset for free text")
            )
            return None
        return Constraint(kind)
    if kind == "choice":
        return _parse_choices(list(msg.choice.values), v)
    text: str = getattr(msg, kind)
    if len(text) > MAX_CONSTRAINT_CHARS:
        v.append(FieldViolation(field, f"longer than {MAX_CONSTRAINT_CHARS} characters"))
        return None
    problem = _TEXT_CHECKS[kind](text)
    if problem is not None:
        v.append(FieldViolation(field, problem))
        return None
    return Constraint(kind, text=text)


def _parse_choices(values: list[str], v: list[FieldViolation]) -> Constraint | None:
    field = "constraint.choice.values"
    if not values:
        v.append(FieldViolation(field, "give at least one choice"))
        return None
    if len(values) > MAX_CHOICES:
        v.append(FieldViolation(field, f"at most {MAX_CHOICES} choices ({len(values)})"))
        return None
    if sum(len(c) for c in values) > MAX_CONSTRAINT_CHARS:
        v.append(FieldViolation(field, f"longer than {MAX_CONSTRAINT_CHARS} characters in all"))
        return None
    for i, c in enumerate(values):
        if not c:
            v.append(FieldViolation(f"{field}[{i}]", "a choice must not be empty"))
            return None
    return Constraint("choice", choices=tuple(values))


def _schema_problem(text: str) -> str | None:
    if not text.strip():
        return "empty: give a JSON Schema as JSON text"
    try:
        schema: Any = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(schema, dict):
        return f"a JSON Schema here is a JSON object, got {type(schema).__name__}"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        return f"not a valid JSON Schema{f' at {where}' if where else ''}: {exc.message}"
    except jsonschema.exceptions.UnknownType as exc:
        return f"not a valid JSON Schema: {exc}"
    return None


def _regex_problem(text: str) -> str | None:
    if "\x00" in text:
        return "must not contain a NUL character"
    try:
        re.compile(text)
    except re.error as exc:
        return f"not a valid regular expression: {exc}"
    return None


def _grammar_problem(text: str) -> str | None:
    if not text.strip():
        return "empty: give a grammar (EBNF or Lark)"
    if "\x00" in text:
        return "must not contain a NUL character"
    return None


# What is wrong with a text constraint, per kind (None: nothing the control plane can see).
_TEXT_CHECKS: dict[str, Callable[[str], str | None]] = {
    "json_schema": _schema_problem,
    "regex": _regex_problem,
    "grammar": _grammar_problem,
}
