"""/metrics of the tiered prefix cache (pagedjax.kv_offload.tiers), one series a tier
(tier="host" | "disk"): hits, misses, evictions, blocks and bytes moved each way (direction
"in": into the tier, "out": back up toward the device), transfer time, failures by kind, and the
bytes used against the capacity. They follow the engine's running totals (EngineStats.kv_tiers)
step by step."""

from __future__ import annotations

import prometheus_client as prom

# KVTiers.counters' names -> (metric, documentation, extra label)
COUNTERS = {
    "hits": ("kv_tier_hits", "Blocks served from a tier of the prefix cache below the device "
             "(the host's loaded to the device, the disk's read up to the host).", None),
    "misses": ("kv_tier_misses", "Blocks of admitted prompts asked of a tier that it did not "
               "hold.", None),
    "evictions": ("kv_tier_evictions", "Blocks a tier dropped to make room (the host's go on "
                  "to disk when it is on).", None),
    "blocks_in": ("kv_tier_blocks_moved", "Blocks moved into (direction=in) and up out of "
                  "(direction=out) a tier.", ("direction", "in")),
    "blocks_out": ("kv_tier_blocks_moved", "", ("direction", "out")),
    "bytes_in": ("kv_tier_bytes_moved", "Bytes moved into (direction=in) and up out of "
                 "(direction=out) a tier.", ("direction", "in")),
    "bytes_out": ("kv_tier_bytes_moved", "", ("direction", "out")),
    "transfer_s": ("kv_tier_transfer_seconds", "Time spent moving a tier's blocks (the host's: "
                   "the engine thread's issuing and waiting; the disk's: reads and writes).",
                   None),
    "overflow": ("kv_tier_failures", "Blocks a tier could not keep or serve, by kind "
                 "(overflow: evicted with every host slot in use by the step; corrupt: disk "
                 "files refused; dropped_writes: a full write queue; write_errors: the disk "
                 "tier turned off).", ("kind", "overflow")),
    "corrupt": ("kv_tier_failures", "", ("kind", "corrupt")),
    "dropped_writes": ("kv_tier_failures", "", ("kind", "dropped_writes")),
    "write_errors": ("kv_tier_failures", "", ("kind", "write_errors")),
}


class TierMetrics:
    def __init__(self, registry: prom.CollectorRegistry, labels: dict[str, str]):
        self.labels = labels
        names = list(labels) + ["tier"]
        self._counters: dict[str, prom.Counter] = {}
        for metric, doc, extra in COUNTERS.values():
            if metric not in self._counters:
                self._counters[metric] = prom.Counter(
                    f"pagedjax:{metric}", doc, names + ([extra[0]] if extra else []),
                    registry=registry)
        self.used = prom.Gauge("pagedjax:kv_tier_used_bytes", "Bytes a tier holds.", names,
                               registry=registry)
        self.capacity = prom.Gauge("pagedjax:kv_tier_capacity_bytes", "A tier's size.", names,
                                   registry=registry)
        self.usage = prom.Gauge("pagedjax:kv_tier_usage_perc", "Fraction of a tier held "
                                "(1 = full).", names, registry=registry)
        self._last: dict[tuple[str, str], float] = {}

    def update(self, tiers: dict[str, dict[str, float]]) -> None:
        for tier, counts in tiers.items():
            labels = {**self.labels, "tier": tier}
            for name, (metric, _, extra) in COUNTERS.items():
                if name not in counts:
                    continue
                before = self._last.get((tier, name), 0)
                if counts[name] > before:
                    series = self._counters[metric].labels(
                        **labels, **({extra[0]: extra[1]} if extra else {}))
                    series.inc(counts[name] - before)
                    self._last[tier, name] = counts[name]
            self.used.labels(**labels).set(counts["used_bytes"])
            self.capacity.labels(**labels).set(counts["capacity_bytes"])
            self.usage.labels(**labels).set(counts["used_bytes"] / max(1, counts["capacity_bytes"]))
