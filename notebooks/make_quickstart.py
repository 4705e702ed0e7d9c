"""Writes notebooks/quickstart.ipynb from the cells below (the notebook's single source).

    python notebooks/make_quickstart.py

tests/test_notebook.py checks that the committed notebook equals this script's output and runs
its code cells top to bottom.
"""

from __future__ import annotations

import json
import pathlib

CELLS = [
    ("markdown", """\
# pagedjax quickstart

An LLM inference engine in JAX built on PagedAttention. This notebook loads the model the project
trained itself (a 1 M parameter byte-level Llama, shipped in the repository: no download),
generates with it, and shows the paged KV cache at work: which physical block holds which
request's tokens, which blocks are shared, and how KV usage moves over time.

Runs on a CPU (Colab's default runtime is enough). In Colab, first clone the repository and
`cd` into it (`!git clone <repository> pagedjax` then `%cd pagedjax`); locally, start Jupyter
from the repository after `make demo` has set up `.venv`."""),
    ("code", """\
import importlib.util, os, pathlib, subprocess, sys

root = pathlib.Path.cwd()
if not (root / "pyproject.toml").exists() and (root.parent / "pyproject.toml").exists():
    root = root.parent  # started from notebooks/
if importlib.util.find_spec("pagedjax") is None:  # a fresh runtime: install the project
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", str(root)], check=True)
    sys.path.insert(0, str(root))"""),
    ("markdown", """\
## Load the embedded model

`LLM()` with no argument loads the embedded default checkpoint (an orbax directory written by
`python -m models.train`: the training-to-serving path). Every `EngineConfig` field can be given
here; this pool is deliberately small so the picture below is readable."""),
    ("code", """\
from pagedjax import LLM, SamplingParams
from models.tasks import make_examples

llm = LLM(num_blocks=40, block_size=8, max_model_len=128, max_num_seqs=12,
          max_num_batched_tokens=64, min_seq_bucket=4)
config = llm.engine.model_config
print(f"{config.num_params / 1e6:.2f} M parameters, {config.num_layers} layers, "
      f"{config.num_heads} query heads / {config.num_kv_heads} KV heads, "
      f"vocabulary {config.vocab_size} (bytes + specials)")"""),
    ("markdown", """\
## Generate

The model does two tasks that need the whole prompt: key-value recall from a context of up to
ten pairs, and copying / reversing a string. Prompts are plain strings; the byte tokenizer turns
them into ids and the answers back into text. Its measured accuracy is in
`models/checkpoints/pagedjax-tiny/MODEL_CARD.md`."""),
    ("code", """\
examples = [e for task in ("recall", "copy") for e in make_examples(task, 6, seed=7)]
outputs = llm.generate([e.prompt for e in examples], SamplingParams(max_tokens=24, temperature=0))
for example, out in zip(examples, outputs):
    mark = "ok" if out.text == example.answer else "WRONG"
    print(f"{example.task:<6} ...{example.prompt[-28:]:<28} -> {out.text:<12} "
          f"(expected {example.answer}, {mark})")"""),
    ("markdown", """\
## The KV block map of live requests

Drive the engine step by step: eight questions about one shared context (their prompt
blocks are shared through the prefix cache), a request with four parallel samples (their prompt
blocks are shared, copy-on-write), and a few short prompts. After some steps, draw which
physical block holds which request's tokens. Hatched blocks are held by several requests (the
label says how many); the bar height is how full a block is; block 0 is the null block that
padding points at."""),
    ("code", """\
import matplotlib.pyplot as plt
from models.tasks import recall_queries
from pagedjax.plotting import plot_block_map, plot_kv_usage

engine = llm.engine
longest = max(make_examples("recall", 64, seed=3), key=lambda e: len(e.prompt))  # 10 pairs
queries = recall_queries(longest, 8)  # eight questions about one context
tok = llm.tokenizer
greedy = SamplingParams(max_tokens=24, temperature=0)
for example in queries + make_examples("copy", 3, seed=5):
    engine.add_request(tok.encode(example.prompt), greedy)
engine.add_request(tok.encode("rev:pagedattention="),
                   SamplingParams(max_tokens=24, temperature=0.7, n=4, seed=0))
for _ in range(4):
    engine.step()
plot_block_map(engine.kv_snapshot())
plt.show()"""),
    ("markdown", """\
## KV usage over time

Run the rest to completion and plot the blocks in use per step against the pool, with the running
and waiting sequences: blocks are taken as tokens arrive and freed the moment a request ends."""),
    ("code", """\
answers = {}
while engine.has_unfinished():
    for out in engine.step():
        if out.finished:
            answers[out.request_id] = [c.text for c in out.outputs]
print("parallel samples of rev:pagedattention= (expected noitnettadegap):",
      answers[max(answers, key=int)])
plot_kv_usage(engine.usage_history, engine.num_blocks - 1)
plt.show()"""),
    ("code", """\
stats = engine.stats
print(f"steps {stats.num_steps} (prefill {stats.num_prefill_steps}, decode {stats.num_decode_steps})")
print(f"prefix cache: {stats.num_prefix_hit_tokens} of {stats.num_prefix_query_tokens} prompt "
      f"tokens served from cached blocks ({100 * stats.prefix_hit_rate:.0f}%)")
print(f"peak KV blocks {stats.peak_used_blocks} of {stats.num_blocks}, "
      f"{100 * stats.peak_waste:.1f}% of their slots empty; preemptions {stats.num_preemptions}")
print(f"compiled step programs: {engine.num_compiled_programs} "
      f"(bound {engine.buckets.num_programs})")"""),
    ("markdown", """\
## Serve it

The same engine behind the OpenAI-compatible server (`pagedjax serve` on the command line), here
in a background thread: any OpenAI client can talk to it, with streaming, and `/metrics` has
the Prometheus counters."""),
    ("code", """\
import json, urllib.request
from pagedjax.server import BackgroundServer, build_app

with BackgroundServer(build_app(llm.engine, "pagedjax-tiny")) as url:
    body = {"model": "pagedjax-tiny", "prompt": "rev:colab=", "max_tokens": 12, "temperature": 0}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request))
    print(f"{url}/v1/completions ->", repr(reply["choices"][0]["text"]), reply["usage"])
    metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
    print([line for line in metrics.splitlines() if line.startswith("pagedjax:generation")])"""),
]


def notebook() -> dict:
    cells = []
    for index, (kind, source) in enumerate(CELLS):
        lines = source.splitlines(keepends=True)
        cell = {"cell_type": kind, "id": f"cell-{index}", "metadata": {}, "source": lines}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        cells.append(cell)
    return {"cells": cells, "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}


def render() -> str:
    return json.dumps(notebook(), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    path = pathlib.Path(__file__).with_name("quickstart.ipynb")
    path.write_text(render())
    print(f"wrote {path}")
