"""Shared by the benchmarks: the seeded workload, environment facts, and result writing."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent
RESULTS = ROOT / "results"
sys.path.insert(0, str(ROOT.parent))


def lognormal_workload(num_requests: int, *, seed: int, max_model_len: int,
                       prompt_mu: float = 5.0, prompt_sigma: float = 1.0,
                       output_mu: float = 4.5, output_sigma: float = 1.0):
    """(prompt_len, output_len) pairs, log-normal with long tails, clipped to max_model_len."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(num_requests):
        prompt = int(np.clip(rng.lognormal(prompt_mu, prompt_sigma), 4, max_model_len * 3 // 4))
        output = int(np.clip(rng.lognormal(output_mu, output_sigma), 1, max_model_len - prompt))
        pairs.append((prompt, output))
    return pairs


def add_llama_args(parser, *, hidden: int, intermediate: int, layers: int, heads: int,
                   kv_heads: int, vocab: int) -> None:
    """The random Llama's shape flags of the benchmarks against transformers, and --seed."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--intermediate", type=int, default=intermediate)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--kv-heads", type=int, default=kv_heads)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--seed", type=int, default=0)


def random_hf_llama(args, max_position_embeddings: int):
    """A seeded random transformers Llama of add_llama_args' shape (no bos/eos), eval mode."""
    import torch
    import transformers

    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=max_position_embeddings,
        bos_token_id=None, eos_token_id=None, initializer_range=0.05)
    return transformers.LlamaForCausalLM(config).eval()


def percentiles(values, prefix: str, scale: float = 1e3, unit: str = "ms",
                digits: int = 3) -> dict:
    """{prefix_p50_unit, _p95_, _p99_} of values (seconds, times scale; None values left out),
    NaN when there are none: every latency table reports all three."""
    values = [v for v in values if v is not None]
    out = {}
    for q in (50, 95, 99):
        value = float(np.percentile(values, q)) * scale if len(values) else float("nan")
        out[f"{prefix}_p{q}_{unit}"] = round(value, digits)
    return out


def add_engine_flags(parser, **defaults) -> None:
    """The CLI's EngineConfig flags (pagedjax.tools.engine_args, as `pagedjax serve` has them),
    defaulting to this benchmark's values where it sets them (EngineConfig's elsewhere)."""
    from pagedjax.tools.engine_args import add_engine_args

    add_engine_args(parser)
    parser.set_defaults(**defaults)


def engine_config(args, **fixed):
    """The EngineConfig of a benchmark's flags (add_engine_flags), with `fixed` fields on top."""
    from pagedjax.engine.config import EngineConfig
    from pagedjax.tools.engine_args import engine_kwargs

    return EngineConfig(**{**engine_kwargs(args), **fixed})


def recorded_args(args) -> dict:
    """A run's flags for its results' params: every one given or defaulted to, without the
    engine flags left unset (None, or a --no-... switch not given)."""
    return {k: v for k, v in vars(args).items() if v is not None and v is not False}


def environment() -> dict:
    env = {"python": platform.python_version(), "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    try:
        import jax
        env.update(jax=jax.__version__, backend=jax.default_backend(),
                   device=str(jax.devices()[0].device_kind))
    except ImportError:
        pass
    return env


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows: not run)"
    keys = list(dict.fromkeys(key for row in rows for key in row))  # every row's, in order
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else str(v)
                 for v in (row.get(key, "") for key in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(name: str, title: str, rows: list[dict], params: dict, notes: str = "", *,
                  results_dir: pathlib.Path = RESULTS, reproduce: str | None = None) -> None:
    """Prints the table and writes <results_dir>/<name>.json and .md (benchmarks/results/)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    table = markdown_table(rows)
    print(f"\n{title}\n\n{table}\n")
    (results_dir / f"{name}.json").write_text(json.dumps(
        {"benchmark": name, "environment": env, "params": params, "rows": rows}, indent=2) + "\n")
    md = [f"# {title}", "", table, "", f"Parameters: `{json.dumps(params)}`", "",
          f"Environment: `{json.dumps(env)}`", ""]
    if notes:
        md += [notes.strip(), ""]
    md.append(f"Reproduce: `{reproduce or f'.venv/bin/python benchmarks/{name}.py'}`")
    (results_dir / f"{name}.md").write_text("\n".join(md) + "\n")


async def stream_completion(client, url: str, body: dict, *,
                            abandon_after_first: bool = False) -> dict:
    """One streamed /v1/completions request (token ids asked back), timed by the client:
    status (-1 when the connection failed), send and end times, a timestamp per event that
    brought tokens, and the tokens received. abandon_after_first: the client goes away after
    the first token."""
    import httpx

    body = {**body, "stream": True, "return_token_ids": True}
    sent = time.perf_counter()
    stamps, tokens, status, ids = [], 0, None, []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            status = response.status_code
            if status != 200:
                await response.aread()
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    data = json.loads(line[6:])
                    if "error" in data:
                        status = 500
                        break
                    new_ids = data["choices"][0].get("token_ids", []) if data["choices"] else []
                    ids += new_ids
                    new = len(new_ids)
                    if new:
                        stamps.append(time.perf_counter())
                        tokens += new
                        if abandon_after_first:
                            break
    except httpx.HTTPError:
        status = -1
    return {"status": status, "sent": sent, "done": time.perf_counter(), "stamps": stamps,
            "tokens": tokens, "token_ids": ids}


def timed_decode(model, *, context: int, batch: int, steps: int,
                 vocab: int = 4096) -> tuple[float, list[float]]:
    """(KV bytes a sequence holds, seconds of each of `steps` decode steps) of `batch` random
    prompts of `context` tokens on an engine of blocks of 16 (no prefix caching), timed once
    every prompt is in (engine.step(): one token a sequence)."""
    from pagedjax import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(model, EngineConfig(
        block_size=16, max_model_len=2 * context + 16, max_num_seqs=batch,
        max_num_batched_tokens=512, min_seq_bucket=batch, enable_prefix_caching=False,
        num_blocks=batch * (context // 8 + 32)))
    rng = np.random.default_rng(0)
    # decoding goes on while the later prompts prefill: room for all of it
    params = SamplingParams(max_tokens=context, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(rng.integers(0, vocab, context).tolist(), params)
           for _ in range(batch)]
    while any(r.num_computed_tokens < context
              for r in engine.scheduler.state.running) or engine.scheduler.state.waiting:
        engine.step()  # the prompts (and a first decode or two)
    held = engine.scheduler.kv_manager.block_tables
    bytes_per_seq = float(np.mean([len(held[i]) for i in ids])) * engine.bytes_per_block
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return bytes_per_seq, times
