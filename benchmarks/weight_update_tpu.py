"""An in-place weight update (LLM.update_weights) of Llama-3-8B served at TP 8 on a v5e-8 slice,
compiled by libtpu for the topology on a machine without TPUs: the device memory each leaf's
write takes, per chip.

update_weights writes the served weights leaf by leaf, each with one program that takes the old
leaf donated and the new values (a trainer's arrays, moved onto the leaf's devices first) and
returns the leaf (pagedjax.engine.weight_writer.write_program). Each row is that program for one
kind of served leaf (bf16, the serving form: layers stacked on [32], KV heads as TP 8 repeats
them, weight_spec's shardings), compiled as one program for the 8 chips (benchmarks.aot.xla_tpu),
abstract (nothing allocated):

- leaf_gib: the leaf's shard on a chip; parts_gib: the new values' shards on a chip (what the
  trainer hands over for that leaf, in the leaf's split);
- output_gib / alias_gib: the program's output and how much of it XLA writes into a donated
  argument's buffers (alias = output: the old leaf's buffers hold the new one);
- temp_gib: XLA's temporaries for the write.

peak_gib (the summary): the weights a chip holds (weight_bytes_per_device) plus the largest
(parts + temp) over the leaves: device memory peaks at the weights plus about one leaf's new
values, never a second copy of the weights (second_copy_gib: what two copies would take). A
trainer colocated on the same chips with the same split hands over arrays that are already
there (device_put moves nothing): then parts_gib is its own memory, not the update's. The
largest leaf is the embedding, which weight_spec replicates on every chip.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from common import ROOT, write_results

CASE = ("llama-3-8b", "v5e:2x4", 8)
HBM_GIB = 16  # v5e


def leaves_of(config, tp):
    """The serving form's leaves of config at TP tp (abstract, with their shardings): a list
    of (path name, ShapeDtypeStruct, KV repeats)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from pagedjax.models import serving_form
    from pagedjax.models.registry import model_class
    from pagedjax.parallel.sharding import kv_head_repeats

    repeats = kv_head_repeats(config.num_kv_heads, tp)
    model = nnx.eval_shape(lambda: model_class(config)(
        config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16))
    _, weights = serving_form(model, kv_head_repeats=repeats)
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(weights):
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path
                        if getattr(k, "name", None) != "value")
        kv = repeats if name.split("/")[-2] in ("k_proj", "v_proj") else 1
        out.append((name, leaf, kv))
    return out


def build(name: str, devices):
    """(the write program, its abstract sharded args) for "<leaf index>"."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    from pagedjax.engine.weight_writer import Part, write_program
    from pagedjax.models import CONFIGS
    from pagedjax.parallel.sharding import AXIS, weight_spec

    model_name, _, tp = CASE
    config = CONFIGS[model_name]
    mesh = Mesh(np.array(devices[:tp]), (AXIS,))
    path_name, leaf, kv = leaves_of(config, tp)[int(name)]
    spec = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(
        mesh, weight_spec(_path(path_name), leaf, config.vocab_size, tp)))
    stacked = path_name.startswith("layers/")
    shape = list(leaf.shape[1:] if stacked else leaf.shape)
    shape[-1] //= kv
    parts = [Part((i,) if stacked else (), None) for i in range(leaf.shape[0] if stacked else 1)]
    program, shardings = write_program(spec, parts, (config.num_kv_heads, kv), "donate")
    values = [jax.ShapeDtypeStruct(tuple(shape), leaf.dtype, sharding=s) for s in shardings]
    return program, (spec, *values)


def _path(name: str) -> tuple:
    """A path weight_spec reads from a leaf's name."""
    from jax.tree_util import DictKey, GetAttrKey

    first, *rest = name.split("/")
    return (GetAttrKey(first), *[DictKey(k) for k in rest], GetAttrKey("value"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libtpu", default=str(ROOT.parent / ".venv" / "libtpu"))
    args = parser.parse_args()
    from benchmarks.aot import xla_tpu
    from pagedjax.models import CONFIGS
    from pagedjax.parallel.sharding import weight_bytes_per_device

    model_name, topology, tp = CASE
    config = CONFIGS[model_name]
    leaves = leaves_of(config, tp)
    with tempfile.TemporaryDirectory() as tmp:
        lines, _ = xla_tpu.run_in_child(
            [{"name": str(i), "module": "weight_update_tpu", "function": "build",
              "sharded": True} for i in range(len(leaves))],
            os.path.join(tmp, "cases.json"), libtpu=args.libtpu, topology=topology,
            pythonpath=[ROOT, ROOT.parent], cwd=ROOT.parent, timeout=3600)
    rows, extra = [], 0.0
    for line, (name, leaf, _) in zip(lines, leaves):
        row = {"leaf": name, "shape": list(leaf.shape), "ok": line["ok"]}
        if line["ok"]:
            leaf_gib = line["output_gib"]
            parts = line["argument_gib"] - leaf_gib
            row.update(leaf_gib=round(leaf_gib, 4), parts_gib=round(parts, 4),
                       output_gib=round(line["output_gib"], 4),
                       alias_gib=round(line["alias_gib"], 4),
                       temp_gib=round(line["temp_gib"], 4), compile_s=line["seconds"])
            extra = max(extra, parts + line["temp_gib"])
        else:
            row["error"] = line["error"][:300]
        rows.append(row)
        print(row, flush=True)
    weights = weight_bytes_per_device(config, tp, 2) / 2**30
    summary = {"case": f"{model_name} TP{tp} {topology}", "weights_gib": round(weights, 3),
               "largest_leaf_write_extra_gib": round(extra, 3),
               "peak_gib": round(weights + extra, 3), "second_copy_gib": round(2 * weights, 3),
               "hbm_gib": HBM_GIB}
    print(summary)
    verdict = (f"\n\nPer chip: weights {summary['weights_gib']} GiB; the largest leaf write adds "
               f"{summary['largest_leaf_write_extra_gib']} GiB (its new values and XLA's "
               f"temporaries): peak {summary['peak_gib']} GiB of {HBM_GIB}, against "
               f"{summary['second_copy_gib']} GiB for a second copy of the weights.")
    write_results("weight_update_tpu", "An in-place weight update of Llama-3-8B at TP 8 on a "
                  "v5e-8, compiled by libtpu (AOT, no TPU): per-chip memory of each leaf's write",
                  rows, summary, __doc__.split("\n\n", 1)[1] + verdict,
                  reproduce="`.venv/bin/python benchmarks/weight_update_tpu.py`")


if __name__ == "__main__":
    main()
