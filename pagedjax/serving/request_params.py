"""What a request body asks of the engine: its SamplingParams (the engine's errors spelled with
the body's field names) and what the trace notes of it."""

from __future__ import annotations

from typing import Any

import fastapi

from pagedjax.scheduler import RequestError, RequestOutputKind, SamplingParams
from pagedjax.scheduler.structured_outputs import KINDS
from pagedjax.serving.http_common import APIError
from pagedjax.serving.protocol import _SamplingFields
from pagedjax.serving.structured import structured_outputs

STRUCTURED_FIELDS = ("structured_outputs", *(f"structured_outputs.{kind}" for kind in KINDS))


# An endpoint's body field for each of the engine's request fields (None: the field has no
# spelling of its own there: an error names no param); sampling_params adds the structured
# output fields' for the request
ParamNames = dict[str, "str | None"]

def sampling_params(body: _SamplingFields, max_tokens: int, logprobs: int | None,
                    best_of: int | None, params_of: ParamNames,
                    prompt_logprobs: int | None = None,
                    constraint: tuple[str, dict] | None = None,
                    prediction: list[int] | None = None) -> SamplingParams:
    """The body's SamplingParams, or APIError 400 naming the body's field; params_of maps the
    engine's field names to the endpoint's (structured outputs add theirs); constraint: (field,
    StructuredOutputs kwargs) a field other than the structured-output ones implies (tool
    calling's); prediction: the body's Predicted Outputs, tokenized."""
    kwargs: dict[str, Any] = dict(max_tokens=max_tokens, n=body.n, best_of=best_of,
                                  prompt_logprobs=prompt_logprobs,
                                  seed=body.seed, ignore_eos=body.ignore_eos,
                                  skip_special_tokens=body.skip_special_tokens,
                                  include_stop_str_in_output=body.include_stop_str_in_output,
                                  logprobs=logprobs, stop=body.stop,
                                  stop_token_ids=tuple(body.stop_token_ids or ()))
    if body.temperature is not None:
        kwargs["temperature"] = body.temperature
    if body.top_p is not None:
        kwargs["top_p"] = body.top_p
    if body.top_k is not None:
        kwargs["top_k"] = -1 if body.top_k == 0 else body.top_k
    if body.min_p is not None:
        kwargs["min_p"] = body.min_p
    if body.logit_bias:
        kwargs["logit_bias"] = _bias_ids(body.logit_bias)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                 "allowed_token_ids", "bad_words"):
        if getattr(body, name) is not None:
            kwargs[name] = getattr(body, name)
    kwargs["min_tokens"] = body.min_tokens
    # what is new since each output (the streams send it; collect() sums it): O(1) host work a
    # token in the engine, its channel and here, where cumulative outputs cost O(tokens so far)
    kwargs["output_kind"] = RequestOutputKind.DELTA
    if prediction is not None:
        kwargs["prediction"] = tuple(prediction)
    kwargs["structured_outputs"], field = structured_outputs(body, constraint)
    if field is not None:  # the engine's errors name the body's field
        params_of.update({name: field for name in STRUCTURED_FIELDS})
    try:
        return SamplingParams(**kwargs)
    except RequestError as e:
        raise rejected(e, params_of) from None


def trace_note(body: _SamplingFields, request: fastapi.Request | None,
               turns: int | None) -> dict:
    """What --trace-out records of a request beside its output: the session (the X-Session-ID
    header, metadata.session_id, or `user`), the stream flag, the workload tag (metadata.workload,
    or "rag" for a chat request with documents) and chat's earlier turns."""
    metadata = getattr(body, "metadata", None) or {}  # a pooling body has none
    header = request.headers.get("x-session-id") if request is not None else None
    workload = metadata.get("workload")
    if workload is None and getattr(body, "documents", None):
        workload = "rag"
    return {"stream": getattr(body, "stream", False), "session": header or metadata.get("session_id") or body.user,
            "turns": turns, "workload": workload}


def _bias_ids(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias (JSON keys are strings) keyed by token id; 400 naming logit_bias."""
    try:
        return {int(token_id): bias for token_id, bias in logit_bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias's keys must be token ids (integers as strings)",
                       "logit_bias") from None


def rejected(error: RequestError, params_of: ParamNames) -> APIError:
    """The engine's RequestError as HTTP 400, its field spelled as the endpoint's body does."""
    field = error.field
    param = params_of.get(field, field) if field is not None and field not in (
        "sampling_params", "request_id") else None
    message = str(error)
    if param is not None and field and message.startswith(field):
        message = param + message[len(field):]
    return APIError(400, message, param)


