"""/metrics of the LoRA adapters (issue 53), following the engine's running totals
(EngineStats.loras) step by step: vLLM's `lora_requests_info` (one series, its labels the
adapters running and waiting and max_lora, its value the time they were seen), the adapters
resident in device slots, and the slot loads, evictions, load time and adapter reads."""

from __future__ import annotations

import time

import prometheus_client as prom

COUNTERS = {  # EngineStats.loras' names -> (metric, documentation)
    "slot_loads": ("lora_slot_loads", "LoRA adapters written into a device slot."),
    "evictions": ("lora_slot_evictions", "LoRA adapters a device slot let go for another."),
    "load_seconds": ("lora_load_seconds", "Time spent writing adapters into device slots."),
    "reads": ("lora_adapter_reads", "LoRA adapters read from disk (again, once the host "
              "cache let one go)."),
}


class LoRAMetrics:
    def __init__(self, registry: prom.CollectorRegistry, labels: dict[str, str]):
        self.labels = labels
        self.info = prom.Gauge("pagedjax:lora_requests_info", "Running stats on LoRA requests "
                               "(vLLM's): the adapters running and waiting, as labels.",
                               [*labels, "max_lora", "running_lora_adapters",
                                "waiting_lora_adapters"], registry=registry)
        self.resident = prom.Gauge("pagedjax:lora_adapters_resident", "LoRA adapters held in "
                                   "device slots.", list(labels), registry=registry)
        self.counters = {name: prom.Counter(f"pagedjax:{metric}", doc, list(labels),
                                            registry=registry)
                         for name, (metric, doc) in COUNTERS.items()}
        self._last: dict[str, float] = {}
        self._info_labels: tuple | None = None

    def update(self, loras: dict) -> None:
        if not loras:
            return
        info = (str(loras["max_lora"]), ",".join(loras["running"]),
                ",".join(loras["waiting"]))
        if info != self._info_labels:
            if self._info_labels is not None:
                self.info.remove(*self.labels.values(), *self._info_labels)
            self._info_labels = info
        self.info.labels(*self.labels.values(), *info).set(time.time())
        self.resident.labels(**self.labels).set(loras["resident"])
        for name, counter in self.counters.items():
            now = loras[name]
            if now > self._last.get(name, 0):
                counter.labels(**self.labels).inc(now - self._last.get(name, 0))
                self._last[name] = now
