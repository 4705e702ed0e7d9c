"""The LoRA slots of Llama-3-8B served at TP 8 on a v5e-8 (issue 53): 64 slots of rank 16 for
every projection of all 32 layers (bf16), split as the engine splits them
(pagedjax.lora.slot_weights.slot_shardings: column-parallel b on its output, row-parallel a on
its input, the rest replicated), and the program that writes one adapter into a slot, compiled by
libtpu for the topology on a machine without TPUs (benchmarks.aot.xla_tpu): what a chip holds.

Rows: slots_gib: the slots on one chip (the compiled write's donated argument, aliased to its
output); adapter_gib: one adapter's host arrays as the write takes them (on one chip); temp_gib:
XLA's temporaries for the write; replicated_gib: what a chip would hold were the slots
replicated (all 64 slots whole); one_adapter_gib: one adapter padded to rank 16, whole.

    .venv/bin/python benchmarks/lora_tpu.py
"""

from __future__ import annotations

import argparse
import os
import tempfile

from common import ROOT, write_results

CASE = ("llama-3-8b", "v5e:2x4", 8, 64, 16)  # model, topology, TP, slots, rank
HBM_GIB = 16  # v5e


def spec():
    import jax.numpy as jnp

    from pagedjax.lora.slot_weights import SlotSpec
    from pagedjax.models import CONFIGS
    from pagedjax.parallel.sharding import kv_head_repeats

    model, _, tp, slots, rank = CASE
    config = CONFIGS[model]
    return SlotSpec.for_model(config, slots, rank, jnp.bfloat16,
                              kv_head_repeats(config.num_kv_heads, tp))


def build(name, devices):
    """(the slot write, its abstract sharded arguments) over the first TP devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from pagedjax.lora.slot_weights import _write, slot_shardings
    from pagedjax.parallel.sharding import AXIS

    slot_spec = spec()
    mesh = Mesh(np.array(devices[:CASE[2]]), (AXIS,))
    shardings = slot_shardings(slot_spec, mesh=mesh)
    slots = {name: tuple(jax.ShapeDtypeStruct(shape, slot_spec.dtype, sharding=sharding)
                         for shape, sharding in zip(shapes, shardings[name]))
             for name, shapes in slot_spec.shapes().items()}
    whole = NamedSharding(mesh, P())
    arrays = {name: tuple(jax.ShapeDtypeStruct(shape[:1] + shape[2:], slot_spec.dtype,
                                               sharding=whole) for shape in shapes)
              for name, shapes in slot_spec.shapes().items()}
    out = jax.tree.map(lambda s: s.sharding, slots)
    return (jax.jit(_write, donate_argnums=(0,), out_shardings=out),
            (slots, jax.ShapeDtypeStruct((), jnp.int32, sharding=whole), arrays))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libtpu", default=str(ROOT.parent / ".venv" / "libtpu"))
    args = parser.parse_args()
    from benchmarks.aot import xla_tpu

    model, topology, tp, num_slots, rank = CASE
    slot_spec = spec()
    with tempfile.TemporaryDirectory() as tmp:
        [line], _ = xla_tpu.run_in_child(
            [{"name": "write", "module": "lora_tpu", "function": "build", "sharded": True}],
            os.path.join(tmp, "cases.json"), libtpu=args.libtpu, topology=topology,
            pythonpath=[ROOT, ROOT.parent], cwd=ROOT.parent, timeout=1800)
    if not line["ok"]:
        raise SystemExit(line["error"][:2000])
    adapter = slot_spec.nbytes / num_slots / 2**30
    row = {"case": f"{model} TP{tp} {topology}", "slots": num_slots, "rank": rank,
           "slots_gib": round(line["alias_gib"], 3),
           "adapter_gib": round(line["argument_gib"] - line["alias_gib"], 3),
           "temp_gib": round(line["temp_gib"], 3),
           "replicated_gib": round(slot_spec.nbytes / 2**30, 3),
           "one_adapter_gib": round(adapter, 4), "hbm_gib": HBM_GIB,
           "compile_s": line["seconds"]}
    print(row)
    write_results("lora_tpu", "LoRA slots of Llama-3-8B at TP 8 on a v5e-8, compiled by libtpu "
                  "(AOT, no TPU): per-chip memory of 64 rank-16 slots", [row],
                  {"case": list(CASE)}, __doc__.split("\n\n", 1)[1],
                  reproduce="`.venv/bin/python benchmarks/lora_tpu.py`")


if __name__ == "__main__":
    main()
