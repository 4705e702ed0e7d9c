"""The KV cache groups of a model (vLLM V1's hybrid KV cache): its layers grouped by attention
window, every group the same number of layers, so that one block id is one page in each of the
cache's layer slots and every group draws from one pool with one page size.

With S layers a group (the fewest layers any window has), a window with n layers fills
ceil(n / S) groups, the last padded (its missing layers' slots unused). Layer l runs in group
layer_group[l] at cache slot layer_slot[l]: it reads and writes block b of its group's tables as
physical block layer_slot[l] * NB + b. A model whose layers share one window has one group of all
its layers (slot = layer), the layout of every cache before groups.

Linear-attention layers (Gated DeltaNet) form groups of their own, marked LINEAR: they keep a
fixed state a sequence, in blocks of the same pool (the engine sets how many a request holds:
scheduler.state_group.StateWindow), so they too fill groups of S layers."""

from __future__ import annotations

import dataclasses

from pagedjax.models.config import LlamaConfig

LINEAR = "linear_attention"  # the window of a group of linear-attention layers


@dataclasses.dataclass(frozen=True)
class KVCacheGroups:
    # each group's attention window (None: full attention; LINEAR, or the engine's StateWindow
    # once sized: a linear-attention group's state)
    windows: tuple
    layer_group: tuple[int, ...]  # per layer
    layer_slot: tuple[int, ...]  # per layer: its slot in the cache's layer axis
    num_slots: int  # S: layers a group holds (the cache's layer axis)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        return self.num_groups > 1


def kv_cache_groups(config: LlamaConfig, hybrid: bool = True) -> KVCacheGroups:
    """The groups of config's layers; hybrid False (vLLM's --disable-hybrid-kv-cache-manager):
    one group of every layer, each keeping the whole context (the window then only masks)."""
    windows = [LINEAR if config.layer_is_linear(i) else config.layer_window(i)
               for i in range(config.num_layers)]
    if LINEAR in windows and (not hybrid or set(windows) == {LINEAR}):
        raise ValueError("linear-attention layers are served beside attention layers, in the "
                         "hybrid KV cache manager's state group: a model of them alone, or "
                         "the hybrid manager disabled, is not supported")
    if not hybrid or len(set(windows)) == 1:
        return KVCacheGroups((config.shared_window,), (0,) * config.num_layers,
                             tuple(range(config.num_layers)), config.num_layers)
    # full first, then sliding by window, linear last
    kinds = sorted(set(windows), key=lambda w: (w == LINEAR, w is not None,
                                                0 if w in (None, LINEAR) else w))
    by_kind = {w: [i for i, lw in enumerate(windows) if lw == w] for w in kinds}
    size = min(len(layers) for layers in by_kind.values())
    group_windows: list = []
    layer_group, layer_slot = [0] * config.num_layers, [0] * config.num_layers
    for window in kinds:
        layers = by_kind[window]
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start:start + size]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(window)
    return KVCacheGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)
