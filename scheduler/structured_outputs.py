"""What a structured-output request constrains its output to (vLLM's StructuredOutputsParams).

Plain data, checked on construction: exactly one kind. The grammar itself is compiled by the
engine (pagedjax.engine.grammar, with llguidance), which also refuses a grammar it cannot
compile, by this field's name.
"""

from __future__ import annotations

import dataclasses
import json

from pagedjax.scheduler.errors import RequestError, check_bool

MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar text
MAX_CHOICES = 4096
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """One of: json (a JSON schema, as a dict or its text), regex, choice (the output is one of
    these strings), grammar (EBNF: Lark or llama.cpp's GBNF), json_object (any JSON object).
    disable_any_whitespace: JSON without whitespace between tokens (vLLM's flag)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        field = "structured_outputs"
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(field, f"{field} must set exactly one of {', '.join(KINDS)}, "
                               f"got {', '.join(given) or 'none'}")
        check_bool(f"{field}.disable_any_whitespace", self.disable_any_whitespace)
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            text = value if isinstance(value, str) else _dumps(value)
            if not isinstance(value, (str, dict)):
                raise RequestError(f"{field}.json", "structured_outputs.json must be a JSON "
                                   f"schema (an object or its text), got {type(value).__name__}")
            _check_length(f"{field}.json", text)
        elif kind == "json_object":
            check_bool(f"{field}.json_object", value)
        elif kind == "choice":
            if not value or len(value) > MAX_CHOICES or not all(
                    isinstance(c, str) and c for c in value):
                raise RequestError(f"{field}.choice", f"structured_outputs.choice must hold 1 to "
                                   f"{MAX_CHOICES} non-empty strings")
            _check_length(f"{field}.choice", "".join(value))
        else:
            if not isinstance(value, str) or not value:
                raise RequestError(f"{field}.{kind}", f"structured_outputs.{kind} must be a "
                                   f"non-empty string")
            _check_length(f"{field}.{kind}", value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema_text(self) -> str:
        """The JSON schema as text (json_object: any object)."""
        if self.json_object:
            return '{"type": "object"}'
        return self.json if isinstance(self.json, str) else _dumps(self.json)


def _dumps(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as error:
        raise RequestError("structured_outputs.json", f"structured_outputs.json is not JSON: "
                           f"{error}") from None


def _check_length(field: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise RequestError(field, f"{field} is {len(text)} characters, more than "
                           f"{MAX_GRAMMAR_CHARS}")
