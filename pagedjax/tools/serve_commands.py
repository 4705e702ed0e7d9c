"""`pagedjax serve` (an engine behind the OpenAI-compatible server) and `pagedjax router` (the
KV-aware proxy over several)."""

from __future__ import annotations

import argparse
import threading
import time

from pagedjax.tools.engine_args import add_engine_args, engine_kwargs


def serve_args(parser: argparse.ArgumentParser) -> None:
    _model_args(parser)
    _server_args(parser)
    _admission_args(parser)
    _degradation_args(parser)
    add_engine_args(parser)
    from pagedjax.parallel import multihost
    multihost.add_args(parser)


def _model_args(parser: argparse.ArgumentParser) -> None:
    """The model, its tokenizer and chat template, tools, reasoning, the Responses store."""
    parser.add_argument("model", nargs="?", default=None,
                        help="a Hugging Face or orbax directory, a .gguf file, or a config name "
                        "(default: the embedded trained model)")
    parser.add_argument("--tokenizer", help="a tokenizer directory, or 'byte'")
    parser.add_argument("--chat-template", help="a Jinja chat template, a file holding one, or "
                        "the name of one pagedjax ships (tool_chatml: ChatML with tools, the "
                        "hermes format), for a model whose tokenizer has none (or to replace "
                        "its own)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice \"auto\" (the default with tools): the reply's "
                        "tool calls read by --tool-call-parser")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="every usage object says how many prompt tokens the prefix cache "
                        "served (prompt_tokens_details.cached_tokens), as vLLM's flag")
    parser.add_argument("--responses-store-size", type=int, default=1000,
                        help="responses the Responses API keeps (for GET /v1/responses/{id} and "
                        "previous_response_id), the oldest dropped first; 0 keeps none")
    parser.add_argument("--responses-store-max-bytes", type=int, default=256 * 2**20,
                        help="the most bytes (the responses' and their conversations' JSON) "
                        "the Responses API's store holds, the oldest ended response dropped "
                        "first (default 256 MiB); a running background response is kept")
    parser.add_argument("--responses-store-ttl", type=float, default=3600.0,
                        help="seconds a stored response is kept")
    parser.add_argument("--reasoning-parser", default=None,
                        help="split a thinking model's <think>...</think> into "
                        "reasoning_content: deepseek_r1 (the reply starts thinking) or qwen3 "
                        "(it thinks when it opens <think>)")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=[],
                        metavar="NAME=PATH", help="LoRA adapters (PEFT directories) requests "
                        "pick by the model field: name=path, or JSON {\"name\", \"path\", "
                        "\"base_model_name\"} (needs --enable-lora)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true", default=None,
                        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (also: "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
    parser.add_argument("--allowed-lora-paths", nargs="+", action="extend", default=[],
                        metavar="DIR", help="runtime adapter loads only from under these "
                        "directories (anything else: a 400 that reveals nothing of the path)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="how the model writes tool calls: hermes (<tool_call> JSON "
                        "</tool_call>: ChatML, Qwen) or llama3_json (Llama 3.1/3.2 JSON)")


def _server_args(parser: argparse.ArgumentParser) -> None:
    """Where and how the server listens: address, name, configuration file, keys, limits,
    warmup, where the engine steps, the trace, logging."""
    import os

    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port to listen on")
    parser.add_argument("--served-model-name",
                        help="the name clients send as `model` (default: the model's)")
    parser.add_argument("--config", metavar="FILE",
                        help="a versioned serving configuration (.yaml / .json: version, model, "
                        "engine and server settings; pagedjax/serving/serving_config.py) instead "
                        "of the engine and serving flags")
    parser.add_argument("--admin-key", default=os.environ.get("PAGEDJAX_ADMIN_KEY"),
                        help="serve /admin/config (apply a new configuration version live) and "
                        "/admin/config/rollback behind 'Authorization: Bearer KEY' (or "
                        "PAGEDJAX_ADMIN_KEY); without a key they do not exist")
    parser.add_argument("--api-key", default=os.environ.get("PAGEDJAX_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(or PAGEDJAX_API_KEY)")
    parser.add_argument("--public-metrics", action="store_true",
                        help="with --api-key, leave /metrics open (a Prometheus scraper)")
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                        help="answer 413 to a larger request body, unread (default 4 MiB)")
    warmup = parser.add_mutually_exclusive_group()
    warmup.add_argument("--warmup", action="store_true",
                        help="compile every step program before accepting requests")
    warmup.add_argument("--warmup-background", action="store_true",
                        help="accept requests at once and compile every step program in a "
                        "background thread (a shape not compiled yet compiles on first use)")
    parser.add_argument("--engine-core", choices=("process", "thread"), default="process",
                        help="where the engine steps: a process of its own behind the server "
                        "(default; vLLM V1's shape: the step never waits on the server's event "
                        "loop) or a thread of the server's process (always, multi-host)")
    parser.add_argument("--trace-out", help="append every finished request to this JSON-lines "
                        "trace (lengths, arrival, prefix hashes; no text) for `pagedjax "
                        "simulate`")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level")


def _admission_args(parser: argparse.ArgumentParser) -> None:
    admission = parser.add_argument_group(
        "admission control (HTTP 429 with its reason; pagedjax/frontend/admission_control.py)")
    admission.add_argument("--max-outstanding-tokens", type=int,
                           help="refuse a request that would raise the tokens still to compute "
                           "over all requests above this")
    admission.add_argument("--kv-overcommit", type=float, metavar="F",
                           help="refuse a request when the KV blocks in use, plus those the live "
                           "requests may still take, plus its own would exceed F x the pool")
    admission.add_argument("--long-context-threshold", type=int, metavar="TOKENS",
                           help="prompts longer than this are long-context requests (with "
                           "--max-long-context-requests)")
    admission.add_argument("--max-long-context-requests", type=int, metavar="N",
                           help="at most N live long-context requests")
    admission.add_argument("--max-non-streamed-requests", type=int, metavar="N",
                           help="at most N live requests whose client does not stream")
    admission.add_argument("--max-concurrent-requests", type=int, metavar="N",
                           help="at most N live requests")
    admission.add_argument("--max-tokens-cap", type=int, metavar="N",
                           help="cut every request's max_tokens to N (the response's "
                           "X-PagedJAX-Max-Tokens-Capped header says so)")
    admission.add_argument("--default-max-tokens", type=int, default=512, metavar="N",
                           help="a chat request's max_tokens when it gives none (at most what "
                           "the context leaves; 0: all of it, as vLLM)")


def _degradation_args(parser: argparse.ArgumentParser) -> None:
    degrade = parser.add_argument_group(
        "automatic degradation (pagedjax/serving/degradation.py): levels 1 cut max_tokens, 2 "
        "shed long-context requests, 3 lower concurrency")
    degrade.add_argument("--degrade-ttft-p99", type=float, metavar="SECONDS",
                         help="step down while the window's p99 time to first token exceeds it")
    degrade.add_argument("--degrade-itl-p99", type=float, metavar="SECONDS",
                         help="step down while the window's p99 inter-token latency exceeds it")
    degrade.add_argument("--degrade-oom-burst", type=int, metavar="N",
                         help="step down when N device OOMs fall in the window")
    degrade.add_argument("--degrade-window", type=float, default=60.0, metavar="SECONDS",
                         help="the sliding window the signals are judged over")
    degrade.add_argument("--degrade-hold", type=float, default=30.0, metavar="SECONDS",
                         help="time between two steps, and healthy time before a step back up")


def serve(args, parser: argparse.ArgumentParser) -> None:
    """An OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming; /metrics,
    /health) for MODEL: a Hugging Face or orbax directory, a .gguf file, or a config name
    (default: the embedded trained model)."""
    import os

    from pagedjax.parallel import multihost

    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    config = _serving_config(args, parser)
    _check_server_flags(args, parser)

    from pagedjax.frontend.llm import DEFAULT_MODEL
    from pagedjax.serving.app import run_server

    model = args.model or config.model or DEFAULT_MODEL
    try:
        follower = multihost.start_from_args(args)
        if args.engine_core == "process" and not multihost.requested(args):
            engine = _start_engine_core(model, args, config)
        else:
            engine = _in_process_engine(model, args, config, follower)
    except (ValueError, RuntimeError) as e:  # RuntimeError: the engine core failed to start
        parser.exit(1, f"pagedjax serve: {e}\n")
    if engine is None:
        return
    name = args.served_model_name or os.path.basename(os.path.normpath(str(model)))
    status = run_server(engine, name, host=args.host, port=args.port,
                        config=config, admin_key=args.admin_key, api_key=args.api_key,
                        trace_out=args.trace_out, log_level=args.log_level,
                        max_request_bytes=args.max_request_bytes,
                        public_metrics=args.public_metrics,
                        chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
                        enable_auto_tool_choice=args.enable_auto_tool_choice,
                        reasoning_parser=args.reasoning_parser,
                        responses_store_size=args.responses_store_size,
                        responses_store_ttl_s=args.responses_store_ttl,
                        responses_store_max_bytes=args.responses_store_max_bytes,
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        lora_modules=args.lora_modules,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                        allowed_lora_paths=args.allowed_lora_paths)
    if status:
        parser.exit(status, "pagedjax serve: the engine core died; exiting for a supervisor "
                    "to restart the server\n")


def _check_server_flags(args, parser: argparse.ArgumentParser) -> None:
    """parser.error naming the first server flag out of its range; a chat template read."""
    if args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.responses_store_size < 0 or not args.responses_store_ttl > 0 \
            or args.responses_store_max_bytes < 1:
        parser.error("--responses-store-size must be >= 0, --responses-store-max-bytes >= 1 "
                     "and --responses-store-ttl > 0")
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        parser.error("--enable-auto-tool-choice and --tool-call-parser go together")
    if args.reasoning_parser is not None:
        from pagedjax.serving.reasoning import PARSERS as REASONING
        if args.reasoning_parser not in REASONING:
            parser.error(f"--reasoning-parser must be one of {', '.join(sorted(REASONING))}, "
                         f"got {args.reasoning_parser!r}")
    if args.tool_call_parser is not None:
        from pagedjax.serving.tool_parsers import PARSERS
        if args.tool_call_parser not in PARSERS:
            parser.error(f"--tool-call-parser must be one of {', '.join(sorted(PARSERS))}, got "
                         f"{args.tool_call_parser!r}")
    if args.chat_template is not None:
        from pagedjax.text.tokenizer import read_chat_template
        try:
            args.chat_template = read_chat_template(args.chat_template)
        except ValueError as e:
            parser.error(str(e))


SERVER_FLAGS = ("max_outstanding_tokens", "kv_overcommit", "long_context_threshold",
                "max_long_context_requests", "max_non_streamed_requests",
                "max_concurrent_requests", "max_tokens_cap", "default_max_tokens",
                "degrade_ttft_p99", "degrade_itl_p99", "degrade_oom_burst", "degrade_window",
                "degrade_hold")


def _serving_config(args, parser: argparse.ArgumentParser):
    """The instance's versioned serving configuration: --config's file, or the flags' (version
    "cli"). With --config, engine and serving flags beside it are refused by name."""
    from pagedjax.frontend.admission_control import AdmissionLimits
    from pagedjax.serving.degradation import DegradationPolicy
    from pagedjax.serving.serving_config import ServingConfig

    if args.config is not None:
        given = [name for name in SERVER_FLAGS
                 if getattr(args, name) != parser.get_default(name)] + list(engine_kwargs(args))
        if given:
            parser.error(f"--config holds the serving configuration; drop "
                         f"{', '.join('--' + g.replace('_', '-') for g in sorted(given))}")
        if args.model is not None:
            parser.error("--config names the model (its `model` key); drop MODEL")
        try:
            return ServingConfig.load(args.config)
        except (ValueError, OSError) as e:
            parser.error(f"--config: {e}")
    if args.default_max_tokens is not None and args.default_max_tokens < 0:
        parser.error(f"--default-max-tokens must be >= 0, got {args.default_max_tokens}")
    try:
        return ServingConfig(
            "cli", model=args.model, engine=engine_kwargs(args),
            admission=AdmissionLimits(**{name: getattr(args, name) for name in SERVER_FLAGS[:6]}),
            max_tokens_cap=args.max_tokens_cap, default_max_tokens=args.default_max_tokens or None,
            degradation=DegradationPolicy(
                ttft_p99_s=args.degrade_ttft_p99, itl_p99_s=args.degrade_itl_p99,
                oom_burst=args.degrade_oom_burst, window_s=args.degrade_window,
                hold_s=args.degrade_hold))
    except ValueError as e:
        parser.error(str(e))


def _start_engine_core(model, args, config):
    """The engine in a process of its own (pagedjax.frontend.engine_core), built and warmed
    up (--warmup) before this returns; --warmup-background compiles there while serving."""
    from pagedjax.frontend.core_client import CoreClient
    from pagedjax.frontend.engine_core import LLMFactory

    start = time.perf_counter()
    core = CoreClient(LLMFactory(model, args.tokenizer, dict(config.engine), args.warmup))
    for note in core.notes:
        print(note, flush=True)
    print(f"engine core: process {core.process.pid} ready in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    if args.warmup_background:
        core.start_warmup()
    return core


def _in_process_engine(model, args, config, follower: bool):
    """The engine on a thread of this process (None: a multi-host follower, done)."""
    import jax

    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.engine.memory_budget import describe_held
    from pagedjax.frontend.llm import LLM
    from pagedjax.parallel import multihost

    llm = LLM(model, tokenizer=args.tokenizer, **config.engine)
    print(describe_held(llm.engine), flush=True)
    budget = getattr(llm.engine, "memory_budget", None)  # --gpu-memory-utilization
    if budget is not None:
        print(budget.describe(), flush=True)
    if follower:  # the leader (process 0) serves; this process runs its steps' shards
        print(f"process {jax.process_index()}: following process 0", flush=True)
        if not isinstance(llm.engine, LLMEngine):
            raise ValueError("a multi-host follower runs one generating engine "
                             "(data_parallel_size 1, a decoder model)")
        steps = multihost.follow(llm.engine.runner, reload=llm.update_weights)
        print(f"process {jax.process_index()}: leader stopped after {steps} steps", flush=True)
        return None
    if args.warmup:
        start = time.perf_counter()
        num_programs = llm.engine.warmup(progress=True)
        print(f"warmup: {num_programs} step programs ready in "
              f"{time.perf_counter() - start:.1f} s (compilation cache: "
              f"{llm.engine.compilation_cache_dir or 'off'})", flush=True)
    if args.warmup_background:
        from pagedjax.frontend.engine_core import report_warmup
        threading.Thread(target=report_warmup, args=(llm.engine.start_warmup(progress=True),),
                         daemon=True).start()
    return llm.engine


def router_args(parser: argparse.ArgumentParser) -> None:
    import os

    from pagedjax.parallel.routing_policy import POLICIES

    parser.add_argument("--backend", action="append", required=True,
                        help="a server's base URL (repeat for each)")
    parser.add_argument("--policy", default="kv_aware", choices=POLICIES,
                        help="how a request picks its instance")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="the port to listen on")
    parser.add_argument("--balance-abs", type=int, default=8,
                        help="in-flight difference beyond which load wins over cache affinity")
    parser.add_argument("--balance-rel", type=float, default=1.5,
                        help="in-flight ratio beyond which load wins over cache affinity")
    parser.add_argument("--min-match", type=float, default=0.25,
                        help="least fraction of a prompt's chunks matched to follow affinity")
    parser.add_argument("--index-capacity", type=int, default=100_000, metavar="CHUNKS",
                        help="prompt chunks remembered an instance (about a KV block each): "
                        "size it to what an instance's prefix cache holds, device pool plus "
                        "its --kv-offload-gib and --kv-disk-gib tiers")
    parser.add_argument("--long-context-backend", action="append", default=[],
                        help="an instance for long-context requests only (repeat for each)")
    parser.add_argument("--long-context-threshold", type=int, default=4096, metavar="TOKENS",
                        help="prompts longer than this go to the long-context instances (text "
                        "estimated at 4 characters a token)")
    rollout = parser.add_argument_group("safe rollout")
    rollout.add_argument("--canary", action="append", default=[],
                         help="a canary instance's base URL (repeat for each)")
    rollout.add_argument("--canary-weight", type=float, default=0.0,
                         help="the canary group's share of the traffic, in [0, 1]")
    rollout.add_argument("--rollback-window", type=int, default=200,
                         help="outcomes per group the comparison looks at")
    rollout.add_argument("--rollback-min-requests", type=int, default=20,
                         help="canary outcomes needed before it can be judged")
    rollout.add_argument("--rollback-max-error-delta", type=float, default=0.05,
                         help="roll back when the canary's error rate exceeds the stable "
                         "group's by more than this")
    rollout.add_argument("--rollback-max-latency-ratio", type=float, default=2.0,
                         help="roll back when the canary's median latency exceeds this times "
                         "the stable group's")
    rollout.add_argument("--admin-key", default=os.environ.get("PAGEDJAX_ADMIN_KEY"),
                         help="serve the /router/* admin endpoints, behind 'Authorization: "
                         "Bearer KEY' (or PAGEDJAX_ADMIN_KEY); without a key they do not exist")
    parser.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                        help="answer 413 to a larger request body, unread (default 4 MiB)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level")


def router(args, parser: argparse.ArgumentParser) -> None:
    """An OpenAI-compatible proxy routing each request to the `pagedjax serve` instance most
    likely to hold its prompt's prefix in its KV cache (see pagedjax.serving.router)."""
    from pagedjax.serving.router import run_router

    if not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    guard = dict(window=args.rollback_window, min_requests=args.rollback_min_requests,
                 max_error_delta=args.rollback_max_error_delta,
                 max_latency_ratio=args.rollback_max_latency_ratio)
    try:
        run_router(args.backend, args.policy, host=args.host, port=args.port,
                   log_level=args.log_level, canary=args.canary,
                   canary_weight=args.canary_weight, guard=guard, admin_key=args.admin_key,
                   balance_abs=args.balance_abs, balance_rel=args.balance_rel,
                   min_match=args.min_match, index_capacity=args.index_capacity,
                   max_request_bytes=args.max_request_bytes,
                   long_context=args.long_context_backend,
                   long_context_threshold=args.long_context_threshold)
    except ValueError as e:
        parser.exit(1, f"pagedjax router: {e}\n")
