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


def plot_workload(trace, profile: dict, path: str) -> None:
    """A trace's workload profile as one picture (written to path): prompt and output token
    histograms with p50/p95/p99 marked, the four shares, and arrivals per second over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, name, values in ((axes[0, 0], "prompt_tokens", [r.prompt_len for r in trace]),
                             (axes[0, 1], "output_tokens", [r.output_len for r in trace])):
        ax.hist(values, bins=40, color="tab:blue", alpha=0.7)
        for p, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
            ax.axvline(profile[name][p], color="black", linestyle=style,
                       label=f"{p} {profile[name][p]:.0f}")
        ax.set_xlabel(name.replace("_", " "))
        ax.set_ylabel("requests")
        ax.legend(fontsize=8)
    names = ("multi_turn", "rag", "shared_system_prompt", "streamed")
    shares = [profile[n]["share"] for n in names]
    bars = axes[1, 0].bar([n.replace("_", "\n") for n in names],
                          [100 * s if s is not None else 0 for s in shares], color="tab:green")
    for bar, share in zip(bars, shares):
        axes[1, 0].text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 1,
                        "n/a" if share is None else f"{100 * share:.0f}%", ha="center",
                        fontsize=8)
    axes[1, 0].set_ylim(0, 110)
    axes[1, 0].set_ylabel("% of requests")
    arrivals = profile["arrivals"]
    rates = arrivals["requests_per_s"]
    axes[1, 1].step(arrivals["start_s"] + [arrivals["start_s"][-1] + arrivals["bin_s"]],
                    rates + rates[-1:], where="post")
    axes[1, 1].set_xlabel("seconds since the first arrival")
    axes[1, 1].set_ylabel(f"arrivals / s ({arrivals['bin_s']:g} s bins)")
    fig.suptitle(f"workload: {profile['requests']} requests over {profile['duration_s']:.0f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
