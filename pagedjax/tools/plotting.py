"""Pictures of the paged KV cache (matplotlib, imported only when a picture is drawn).

- plot_block_map(snapshot): the physical blocks as a grid, each coloured by the request whose
  tokens it holds; a block shared by several requests (common prefix, parallel samples) is
  hatched and labelled with its holder count; fill shows how many of its slots hold tokens;
  free blocks that still hold prefix-cached content are outlined.
- plot_kv_usage(history): blocks in use, running and waiting sequences per step.
"""

from __future__ import annotations

from typing import Sequence

from pagedjax.engine.kv_snapshot import KVSnapshot, UsageSample


def plot_block_map(snapshot: KVSnapshot, ax=None, columns: int = 16, legend: bool = True):
    """Draws snapshot on ax (a new figure when None); returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if columns < 1:
        raise ValueError(f"columns must be >= 1, got {columns}")
    rows = -(-snapshot.num_blocks // columns)
    if ax is None:
        _, ax = plt.subplots(figsize=(columns * 0.55, rows * 0.55 + 0.8))
    requests = sorted({r for holders in snapshot.owners.values() for r in holders})
    cmap = plt.get_cmap("tab20")
    colour = {r: cmap(i % 20) for i, r in enumerate(requests)}
    cached = set(snapshot.cached_free)
    for block in range(snapshot.num_blocks):
        x, y = block % columns, rows - 1 - block // columns
        holders = snapshot.owners.get(block, [])
        if block == 0:
            ax.add_patch(Rectangle((x, y), 0.92, 0.92, color="black"))
            continue
        ax.add_patch(Rectangle((x, y), 0.92, 0.92, facecolor="#eeeeee",
                               edgecolor="#555555" if block in cached else "none",
                               linewidth=1.2))
        if not holders:
            continue
        fill = snapshot.tokens.get(block, 0) / snapshot.block_size
        shared = len(holders) > 1
        ax.add_patch(Rectangle((x, y), 0.92, 0.92 * max(fill, 0.08),
                               facecolor=colour[holders[0]],
                               edgecolor="white" if shared else "none", linewidth=0,
                               hatch="///" if shared else None))
        if len(holders) > 1:
            ax.text(x + 0.46, y + 0.46, f"x{len(holders)}", ha="center", va="center",
                    fontsize=7, weight="bold")
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"KV blocks: {len(snapshot.owners)} of {snapshot.num_blocks - 1} held by "
                 f"{len(requests)} requests, {sum(len(h) > 1 for h in snapshot.owners.values())} "
                 f"shared (hatched), {len(cached)} cached free (outlined)", fontsize=9)
    if legend and requests:
        handles = [Patch(color=colour[r], label=r) for r in requests[:20]]
        handles.append(Patch(color="black", label="null block"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
                  title="request", title_fontsize=8)
    return ax


def plot_kv_usage(history: Sequence[UsageSample], num_blocks: int, ax=None):
    """Blocks in use (left axis, against the pool size) and running / waiting sequences (right
    axis) per engine step; returns the axes."""
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("history is empty: run some engine steps first")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    steps = [s.step for s in history]
    ax.fill_between(steps, [s.used_blocks for s in history], step="post", alpha=0.4,
                    label="KV blocks in use")
    ax.axhline(num_blocks, color="black", linestyle="--", linewidth=1, label="pool size")
    ax.set_xlabel("engine step")
    ax.set_ylabel("blocks")
    right = ax.twinx()
    right.step(steps, [s.num_running for s in history], where="post", color="tab:green",
               label="running")
    right.step(steps, [s.num_waiting for s in history], where="post", color="tab:red",
               label="waiting")
    right.set_ylabel("sequences")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="upper right", fontsize=8)
    return ax
