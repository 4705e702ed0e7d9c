"""Loading a Hugging Face checkpoint: time and peak host memory against the size of the weights.

A random Llama checkpoint (sharded safetensors, saved in bf16 by transformers) is loaded in a
fresh process per measurement, so each peak is its own:

- pagedjax: `pagedjax.models.loading.hf.load_hf_model` (safetensors numpy reader, one tensor at a time, cast and
  transposed, then put on the device; on CPU the device buffers are host memory too);
- transformers: `AutoModelForCausalLM.from_pretrained(dir, dtype=...)` on torch CPU, the baseline.

Two peaks, both minus the value just before loading (imports not counted), median of --repeats
fresh processes:

- private: anonymous memory (RssAnon, sampled every millisecond): the copies a loader makes.
  The loaded model must live somewhere, so 1.0x the weights' size at the target dtype is the
  floor; what is above it is transient.
- rss: the kernel's peak RSS (ru_maxrss), which also counts pages of the safetensors files
  mapped while they are read. Those are page cache, not copies, and how many count depends on
  the file system's page state: the same files gave pagedjax 586 MiB when old and 1042 MiB when
  just written, for bf16.

transformers maps the files and, when the stored dtype is the target (bf16 -> bf16), keeps
tensors backed by the mapping, so its private memory stays low there; converting (-> f32) it
copies.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from common import ROOT, write_results

MEASURE = r"""
import json, os, resource, sys, threading, time
sys.path.insert(0, {root!r})
import psutil
which, path, dtype = sys.argv[1:4]

def rss_anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon"))

peak_anon, done = [0], threading.Event()
def sample():  # the kernel keeps no peak of anonymous memory: sample it every millisecond
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], rss_anon())
        time.sleep(0.001)
if which == "pagedjax":
    import jax
    from flax import nnx
    from pagedjax.models.loading.hf import load_hf_model
    jax.devices()
else:
    import torch, transformers
before = psutil.Process().memory_info().rss
before_anon = rss_anon()
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
if which == "pagedjax":
    model = load_hf_model(path, dtype=dtype)
    jax.block_until_ready(nnx.state(model))
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype))
seconds = time.perf_counter() - start
done.set()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(seconds=seconds, before=before, peak=peak, before_anon=before_anon,
                      peak_anon=max(peak_anon[0], rss_anon()))))
"""


def build_checkpoint(path: str, args) -> int:
    """Saves a random Llama (bf16, sharded) under path; returns its parameter count."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=2048)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100MB")
    return sum(p.numel() for p in model.parameters())


def measure(which: str, path: str, dtype: str) -> dict:
    script = MEASURE.format(root=str(ROOT.parent))
    out = subprocess.run([sys.executable, "-c", script, which, path, dtype], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        num_params = build_checkpoint(tmp, args)
        shards = sorted(f for f in os.listdir(tmp) if f.endswith(".safetensors"))
        file_bytes = sum(os.path.getsize(os.path.join(tmp, f)) for f in shards)
        for dtype, itemsize in (("bfloat16", 2), ("float32", 4)):
            weights = num_params * itemsize
            for which in ("pagedjax", "transformers"):
                runs = [measure(which, tmp, dtype) for _ in range(args.repeats)]
                seconds = float(np.median([r["seconds"] for r in runs]))
                extra = float(np.median([r["peak"] - r["before"] for r in runs]))
                anon = float(np.median([r["peak_anon"] - r["before_anon"] for r in runs]))
                rows.append({"loader": which, "dtype": dtype, "weights_MiB": weights / 2**20,
                             "seconds": seconds, "GiB_per_s": file_bytes / 2**30 / seconds,
                             "peak_private_MiB": anon / 2**20,
                             "private_over_weights": anon / weights,
                             "peak_rss_extra_MiB": extra / 2**20,
                             "rss_over_weights": extra / weights})
    write_results("hf_load", "Loading a Hugging Face checkpoint: time and peak host memory",
                  rows, dict(vars(args), num_params=num_params, shards=len(shards),
                             file_MiB=file_bytes / 2**20),
                  notes=__doc__.split("\n\n", 1)[1])


if __name__ == "__main__":
    main()
