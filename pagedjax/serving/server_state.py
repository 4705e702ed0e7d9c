"""ServerState: what the OpenAI-compatible server's endpoints share (pagedjax.serving.app
assembles them into the app): the engine's front-end, the serving configuration and its history,
admission and degradation, metrics, the trace, the Responses store, and the helpers each route
uses (model checks, sampling parameters, encoding, max_tokens caps, queueing, collecting)."""

from __future__ import annotations

import asyncio
import time

import fastapi
from fastapi import responses

from pagedjax.engine.delta_outputs import CumulativeOutput
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import PoolingRequestOutput, RequestOutput
from pagedjax.engine.request_checks import encode_text
from pagedjax.engine.sleep_mode import EngineAsleepError
from pagedjax.frontend.admission_control import AdmissionLimits
from pagedjax.frontend.async_engine import (AsyncLLMEngine, EngineDeadError, OverloadedError,
                                            PromptSpec, RequestFailedError, RequestGroup)
from pagedjax.frontend.core_client import CoreClient
from pagedjax.frontend.engine_client import EngineClient
from pagedjax.scheduler import RequestError, SamplingParams
from pagedjax.serving import reasoning
from pagedjax.serving.degradation import DegradationController, DegradationPolicy, settings_for
from pagedjax.serving.http_common import DEFAULT_MAX_REQUEST_BYTES, APIError
from pagedjax.serving.lora_routes import ServedLoRAs, runtime_updates_from_env
from pagedjax.serving.metrics import ServerMetrics
from pagedjax.serving.protocol import _SamplingFields, usage_json
from pagedjax.serving.request_params import ParamNames, rejected, sampling_params, trace_note
from pagedjax.serving.response_store import (DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S,
                                             ResponseStore)
from pagedjax.serving.serving_config import ConfigHistory, ServingConfig, engine_fields
from pagedjax.serving.tool_parsers import get_parser
from pagedjax.serving.trace_recorder import TraceRecorder
from pagedjax.text.tokenizer import check_chat_template

DEFAULT_MAX_TOKENS = 512  # a chat request's when it gives none (vLLM: the context's remainder)


class ServerState:
    """What the endpoints share over one engine front-end: its settings, metrics, degradation,
    stores, and the helpers every route uses (pagedjax.serving.app.OpenAIServer adds the routes).

    engine: an LLMEngine (stepped on a thread of this process, AsyncLLMEngine) or a
    started engine core (pagedjax.frontend.core_client.CoreClient: the engine in a process
    of its own). api_key guards every route but /health (and /metrics with public_metrics, for a
    scraper); bodies over max_request_bytes answer 413 unread; chat_template replaces the
    tokenizer's (a model with neither refuses chat requests, 400).

    The serving configuration, as a versioned ServingConfig (config), or by its parts:
    admission (admission control's rules; max_outstanding_tokens alone is the token
    budget's shorthand), max_tokens_cap (every request's max_tokens is cut to it, its
    response saying so in X-PagedJAX-Max-Tokens-Capped), default_max_tokens (a chat
    request's when it gives none; None: what the context leaves, as vLLM) and degradation
    (pagedjax.serving.degradation). admin_key enables /admin/config (new versions, live)
    and /admin/config/rollback behind it. enable_auto_tool_choice with tool_call_parser
    (a name of pagedjax.serving.tool_parsers.PARSERS) serves tool_choice "auto";
    reasoning_parser (pagedjax.serving.reasoning.PARSERS) splits a thinking model's reasoning
    from its answer. The Responses API keeps up to responses_store_size responses (0:
    none) and responses_store_max_bytes of their JSON for responses_store_ttl_s seconds (a
    running background response whatever the bounds). enable_prompt_tokens_details adds the prompt
    tokens served from the prefix cache to every usage object (prompt_tokens_details).
    """

    def __init__(self, engine: LLMEngine, served_model_name: str = "pagedjax", *,
                 max_outstanding_tokens: int | None = None, api_key: str | None = None,
                 trace_out: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 public_metrics: bool = False, chat_template: str | None = None,
                 admission: AdmissionLimits | None = None, max_tokens_cap: int | None = None,
                 default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 degradation: DegradationPolicy | None = None,
                 config: ServingConfig | None = None, admin_key: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None,
                 responses_store_size: int = DEFAULT_MAX_ENTRIES,
                 responses_store_ttl_s: float = DEFAULT_TTL_S,
                 responses_store_max_bytes: int = DEFAULT_MAX_BYTES,
                 enable_prompt_tokens_details: bool = False, lora_modules=(),
                 allow_runtime_lora_updating: bool | None = None, allowed_lora_paths=()):
        core = engine if isinstance(engine, CoreClient) else None
        engine = core.engine if core is not None else engine
        config = serving_config(engine, config, max_outstanding_tokens, admission, max_tokens_cap,
                                default_max_tokens, degradation)
        check_server_args(served_model_name, api_key, admin_key, max_request_bytes,
                          tool_call_parser, enable_auto_tool_choice)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        if chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("chat_template needs a tokenizer; this engine has none")
            check_chat_template(chat_template)
        self.chat_template = chat_template or getattr(self.tokenizer, "chat_template", None)
        self.model_name = served_model_name
        self.loras = served_loras(engine, served_model_name, lora_modules,
                                  allow_runtime_lora_updating, allowed_lora_paths)
        self.tool_parser = get_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = reasoning.get_parser(reasoning_parser) if reasoning_parser \
            else None
        self.prompt_tokens_details = bool(enable_prompt_tokens_details)
        self.responses = ResponseStore(responses_store_size, responses_store_ttl_s,
                                       max_bytes=responses_store_max_bytes)
        self.background_responses: dict[str, asyncio.Future] = {}
        self.api_key, self.admin_key = api_key, admin_key
        self.max_request_bytes = max_request_bytes
        self.open_paths = ("/health", "/metrics") if public_metrics else ("/health",)
        self.created = int(time.time())
        self.degradation = DegradationController(config.degradation, apply=self._apply_level)
        self.metrics = ServerMetrics(engine.stats, served_model_name, observer=self.degradation,
                                     held_memory=engine.held_memory)
        self.degradation.on_change = self.metrics.degradation_changed
        self.trace = TraceRecorder(trace_out, engine.clock()) if trace_out else None
        self.async_engine: EngineClient = self._frontend(engine, core, config)
        self.configs = ConfigHistory(config)
        self.apply_config(config)

    def _frontend(self, engine, core, config: ServingConfig) -> EngineClient:
        """The engine's front-end: an AsyncLLMEngine over engine, or the started core."""
        if core is None:
            return AsyncLLMEngine(engine, limits=config.admission, on_step=self._on_step,
                                  on_abort=self._on_abort)
        core.on_step, core.on_abort = self._on_step, self._on_abort
        return core

    def apply_config(self, config: ServingConfig) -> None:
        """Serves the next requests with config's server settings (in-flight requests keep
        theirs); the caller has checked that its engine settings are the running ones."""
        self.admission = config.admission  # as configured; degradation derives from it
        self.max_tokens_cap = config.max_tokens_cap
        self.default_max_tokens = config.default_max_tokens
        self.degradation.policy = config.degradation
        self._apply_level(self.degradation.level)
        self.metrics.serving_config.info({"version": config.version})

    def _on_step(self, info) -> None:  # each step's report (engine thread or core's reader)
        self.metrics.on_step(info)
        self.degradation.evaluate()
        if self.trace is not None:
            self.trace.record(info.outputs)

    # ---- helpers ---------------------------------------------------------------------------

    def check_model_name(self, model: str | None, param: str | None = "model"):
        """The LoRA adapter `model` names (pagedjax.serving.lora_routes), None for the served
        model (or no name); 404 for any other name."""
        if self.loras is not None:
            return self.loras.resolve(model, param)
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param, code="model_not_found")
        return None

    def check_model(self, body: _SamplingFields):
        """The request's LoRA adapter (or None), once its fields are checked."""
        lora = self.check_model_name(body.model)
        for param, why in body.unsupported():
            raise APIError(400, why, param)
        return lora

    def reply_model(self, model: str | None) -> str:
        """The `model` a reply names: the adapter or model the request named (checked)."""
        return model or self.model_name

    def sampling(self, body: _SamplingFields, max_tokens: int, logprobs: int | None,
                 best_of: int | None, params_of: ParamNames,
                 prompt_logprobs: int | None = None,
                 constraint: tuple[str, dict] | None = None) -> SamplingParams:
        text = body.prediction_text()  # its shape checked with the body's fields
        prediction = None
        if text is not None:
            try:
                prediction = encode_text(self.tokenizer, text, "prediction",
                                         add_special_tokens=False)
            except RequestError as e:
                raise APIError(400, str(e), "prediction") from None
        return sampling_params(body, max_tokens, logprobs, best_of, params_of, prompt_logprobs,
                               constraint, prediction)

    async def encode(self, prompt: str | list, field: str) -> tuple[list, str | None]:
        """Token ids of a text prompt (tokenized off the event loop) or the ids as given (the
        engine checks them)."""
        if not isinstance(prompt, str):
            return prompt, None
        try:
            if len(prompt) < 4096:
                return encode_text(self.tokenizer, prompt, field), prompt
            return await asyncio.to_thread(encode_text, self.tokenizer, prompt, field), prompt
        except RequestError as e:
            raise APIError(400, str(e), field) from None

    def max_tokens(self, requested: int | None, default: int) -> tuple[int, int | None]:
        """(the max_tokens a request runs with, the cap that cut it or None): the requested
        value (default when none) cut to --max-tokens-cap and to degradation's cap."""
        value = default if requested is None else requested
        caps = [c for c in (self.max_tokens_cap, self.degradation.max_tokens_cap) if c]
        if caps and value > min(caps):
            return min(caps), min(caps)
        return value, None

    @staticmethod
    def respond(content: dict, capped: int | None) -> responses.JSONResponse:
        return responses.JSONResponse(content, headers=_capped_header(capped))

    @staticmethod
    def stream(events, capped: int | None) -> responses.StreamingResponse:
        return responses.StreamingResponse(events, media_type="text/event-stream",
                                           headers=_capped_header(capped))

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def add(self, specs: list[PromptSpec], params_of: ParamNames,
                  body: _SamplingFields | None = None, request: fastapi.Request | None = None,
                  turns: int | None = None) -> RequestGroup:
        """Queues specs (all or none); with a trace, notes what the trace records of them
        from body and request (session, stream, workload; turns: chat's earlier turns)."""
        self.degradation.evaluate()  # an idle instance recovers too
        trace = self.trace if body is not None else None
        noted = [spec.request_id for spec in specs if spec.request_id is not None]
        if trace is not None and body is not None:
            note = trace_note(body, request, turns)
            for request_id in noted:
                trace.annotate(request_id, **note)
        try:
            return await self.async_engine.add_requests(
                specs, streamed=True if body is None else bool(getattr(body, "stream", False)))
        except BaseException as e:
            if trace is not None:
                for request_id in noted:
                    trace.forget(request_id)
            if isinstance(e, OverloadedError):
                raise APIError(429, str(e), None, "rate_limit_error", "server_overloaded",
                               {"Retry-After": "1"}, reason=e.reason) from None
            if isinstance(e, RequestError):
                raise rejected(e, params_of) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), None, "server_error", "engine_dead") from None
            if isinstance(e, EngineAsleepError):
                raise APIError(503, str(e), None, "server_error", "engine_asleep",
                               {"Retry-After": "1"}) from None
            raise

    def _apply_level(self, level: int) -> None:
        """The instance's knobs for a degradation level, derived from the configured ones (so
        recovering restores them)."""
        limits, cap = settings_for(level, self.degradation.policy, self.admission,
                                   self.max_tokens_cap or self.engine.config.max_model_len,
                                   self.engine.config.max_model_len,
                                   self.async_engine.num_live)
        self.degradation.max_tokens_cap = cap
        self.async_engine.limits = limits

    def _on_abort(self, request_id: str) -> None:  # a client went away before it finished
        self.metrics.forget(request_id)
        if self.trace is not None:
            self.trace.forget(request_id)

    def usage(self, outputs: dict[str, RequestOutput], prediction: bool = False) -> dict:
        """OpenAI's usage of a request's outputs; prediction: it sent Predicted Outputs (the
        drafts its prediction gave, accepted and rejected, are reported)."""
        cached = sum(o.metrics.num_cached_tokens for o in outputs.values())
        drafted = sum(o.metrics.num_draft_tokens for o in outputs.values())
        accepted = sum(o.metrics.num_accepted_draft_tokens for o in outputs.values())
        return usage_json(sum(len(o.prompt_token_ids) for o in outputs.values()),
                          sum(c.num_tokens for o in outputs.values() for c in o.outputs),
                          cached if self.prompt_tokens_details else None,
                          (accepted, drafted - accepted) if prediction else None)

    def gone(self) -> responses.Response:
        return responses.Response(status_code=499)  # nobody reads it: the client has gone

    def model_card(self) -> dict:
        """The served model as /v1/models lists it (with its serving configuration's version)."""
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pagedjax", "root": self.model_name, "parent": None,
                "max_model_len": self.engine.config.max_model_len,
                "config_version": self.configs.active.version}

    def model_cards(self) -> list[dict]:
        """The served model's card, then its LoRA adapters' (parent: the model they adapt)."""
        adapters = [] if self.loras is None else self.loras.cards(
            self.created, self.engine.config.max_model_len)
        return [self.model_card(), *adapters]

    async def collect(self, group: RequestGroup, request: fastapi.Request
                      ) -> dict[str, RequestOutput] | None:
        """Every request's finished output, or None when the client disconnected first (its
        requests are aborted and their blocks freed at once)."""
        final: dict[str, RequestOutput] = {}
        merged: dict[str, CumulativeOutput] = {}

        async def collect():
            async for out in group:
                if isinstance(out, PoolingRequestOutput):
                    final[out.request_id] = out
                    continue
                merged.setdefault(out.request_id, CumulativeOutput()).add(out)  # DELTA ones
                if out.finished:
                    final[out.request_id] = merged.pop(out.request_id).output()

        async with group:
            collecting = asyncio.ensure_future(collect())
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished = collecting.done()
                gone.cancel()
                collecting.cancel()  # a no-op once it is done
            if not finished:
                return None
            try:
                collecting.result()
            except EngineDeadError as e:
                raise APIError(503, str(e), None, "server_error", "engine_dead") from None
            except RequestFailedError as e:
                raise APIError(500, str(e), None, "server_error", "request_failed") from None
        return final


def serving_config(engine, config, max_outstanding_tokens, admission, max_tokens_cap,
                   default_max_tokens, degradation) -> ServingConfig:
    """The ServingConfig a server starts with: config, or one built from its parts (not
    both)."""
    if config is not None:
        if (admission, max_tokens_cap, degradation, max_outstanding_tokens) != (
                None, None, None, None) or default_max_tokens != DEFAULT_MAX_TOKENS:
            raise ValueError("give the serving settings in config or as arguments, not both")
        return config
    if admission is not None and max_outstanding_tokens is not None:
        raise ValueError("give max_outstanding_tokens inside admission, not beside it")
    admission = admission or AdmissionLimits(max_outstanding_tokens=max_outstanding_tokens)
    return ServingConfig(
        "default", engine=engine_fields(engine.config), admission=admission,
        max_tokens_cap=max_tokens_cap, default_max_tokens=default_max_tokens,
        degradation=degradation or DegradationPolicy())


def served_loras(engine, base_name: str, lora_modules, runtime_updates: bool | None,
                 allowed_paths=()):
    """The adapters a server answers to (None: an engine without LoRA)."""
    if not engine.config.enable_lora:
        if lora_modules or runtime_updates or allowed_paths:
            raise ValueError("--lora-modules and runtime LoRA updating need an engine with "
                             "enable_lora (--enable-lora)")
        return None
    if runtime_updates is None:
        runtime_updates = runtime_updates_from_env()
    return ServedLoRAs(base_name, lora_modules, runtime_updates, allowed_paths)


def check_server_args(served_model_name, api_key, admin_key, max_request_bytes,
                      tool_call_parser, enable_auto_tool_choice) -> None:
    """ValueError naming the first server argument out of its range."""
    if not isinstance(served_model_name, str) or not served_model_name:
        raise ValueError(f"served_model_name must be a non-empty string, "
                         f"got {served_model_name!r}")
    if enable_auto_tool_choice != (tool_call_parser is not None):
        raise ValueError("give enable_auto_tool_choice and tool_call_parser together "
                         "(--enable-auto-tool-choice --tool-call-parser NAME)")
    for name, key in (("api_key", api_key), ("admin_key", admin_key)):
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"{name} must be None or a non-empty string")
    if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be an integer >= 1, "
                         f"got {max_request_bytes!r}")


def _capped_header(capped: int | None) -> dict[str, str] | None:
    return None if capped is None else {"X-PagedJAX-Max-Tokens-Capped": str(capped)}


async def _disconnected(request: fastapi.Request) -> None:
    """Returns when the client has gone away (the body is read: the next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
