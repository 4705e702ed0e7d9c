"""A request body's structured-output fields as one StructuredOutputs: OpenAI's
`response_format` (json_object, json_schema), vLLM's `structured_outputs` object and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields. At most one of them
may constrain a request; a second, or a shape this server does not serve, is a 400 naming it.
As in vLLM, a `structured_outputs` object holding options only (disable_any_whitespace) applies
them to the kind another field gives (response_format's schema, a guided_* field).
"""

from __future__ import annotations

from pagedjax.scheduler import RequestError, StructuredOutputs
from pagedjax.serving.http_common import APIError

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# vLLM's StructuredOutputsParams fields this server refuses by name (the rest are served).
_OPTIONS = ("disable_any_whitespace",)
_REFUSED = {"structural_tag": "structural_tag is not supported",
            "whitespace_pattern": "whitespace_pattern is not supported (use "
                                  "disable_any_whitespace)",
            "disable_fallback": None, "disable_additional_properties": None}


def _from_response_format(value: dict) -> dict | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be an object with a 'schema' "
                           "object", "response_format")
        return {"json": spec.get("schema", {"type": "object"})}
    raise APIError(400, f"response_format type must be text, json_object or json_schema, "
                   f"got {str(kind)[:40]!r}", "response_format")


def _from_structured_outputs(value: dict) -> dict:
    value = dict(value)
    for name, why in _REFUSED.items():
        if value.get(name) not in (None, False):
            raise APIError(400, f"structured_outputs.{name}: {why or 'is not supported'}",
                           "structured_outputs")
        value.pop(name, None)
    return value


def structured_outputs(body, constraint: tuple[str, dict] | None = None
                       ) -> tuple[StructuredOutputs | None, str | None]:
    """(the StructuredOutputs of a body's fields, the field it came from), or (None, None);
    APIError 400 naming the field. constraint: (field, kwargs) another field implies (a tool
    choice's schema), exclusive with the others as they are with each other."""
    given: list[tuple[str, dict]] = [constraint] if constraint is not None else []
    options: dict = {}
    if body.response_format is not None:
        spec = _from_response_format(body.response_format)
        if spec is not None:
            given.append(("response_format", spec))
    if body.structured_outputs is not None:
        spec = _from_structured_outputs(body.structured_outputs)
        options = {k: spec.pop(k) for k in _OPTIONS if k in spec}
        if spec:
            given.append(("structured_outputs", spec))
    for field, kind in _GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            given.append((field, {kind: value}))
    if not given:
        if options:
            raise APIError(400, "structured_outputs holds options but no json, regex, choice, "
                           "grammar or json_object", "structured_outputs")
        return None, None
    if len(given) > 1:
        raise APIError(400, f"{given[0][0]} and {given[1][0]} both constrain the output: send "
                       f"one", given[1][0])
    field, spec = given[0]
    try:
        return StructuredOutputs(**spec, **options), field
    except TypeError as error:  # an unknown key of structured_outputs
        raise APIError(400, f"{field}: {str(error)[:200]}", field) from None
    except RequestError as error:
        raise APIError(400, str(error), field) from None
