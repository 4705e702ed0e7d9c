"""An engine's LoRA adapters (issue 53): the ones it knows (by id and name), a host cache of
max_cpu_loras read adapters in least-recently-used order, and the loads into device slots the
scheduler asks for (scheduler.lora_slots; the slots themselves: pagedjax.lora.slot_weights).

An adapter is read and checked when a request first names it (check, before the request is
queued: a bad adapter refuses its request and changes nothing else); an adapter evicted from the
host cache is read again from its path when a slot needs it. Each adapter has a version, bumped
when its weights change (update), so the prefix cache's blocks computed under the old weights
are never served again (its key names the id and the version).

Removing an adapter (remove_lora, the server's unload) is final for its id: requests already
queued or running under it finish, and any request that names the id afterwards is refused (one
the server resolved just before the unload included), so the name is free at once and a load of
it under a new id is never confused with the old one. add_lora may bring a removed id back
explicitly (vLLM's offline remove / add); its version is bumped so no block of the old weights is
served under it.
"""

from __future__ import annotations

import collections
import time

from pagedjax.lora.peft_adapter import LoRAAdapter, read_peft_adapter
from pagedjax.lora.request import LoRARequest
from pagedjax.lora.slot_weights import SlotSpec


class LoRAManager:
    def __init__(self, spec: SlotSpec, model_config, max_cpu_loras: int):
        self.spec = spec
        self.model_config = model_config
        self.max_cpu_loras = max_cpu_loras
        self.adapters: dict[int, LoRARequest] = {}  # id -> the request that named it first
        self.ids: dict[str, int] = {}  # name -> id
        self.versions: dict[int, int] = {}
        self.host: collections.OrderedDict[int, dict] = collections.OrderedDict()  # LRU first
        self.pinned: set[int] = set()  # held only here (updated in memory): never evicted
        self.removed: set[int] = set()  # ids remove_lora let go: no new request may name them
        self.shapes: dict[int, tuple] = {}  # id -> (rank, scaling, targets) as last read
        self.num_reads = 0  # adapters read from disk (again, once the host cache let one go)
        self.num_slot_loads = 0
        self.load_time_s = 0.0

    def check(self, lora: LoRARequest, revive: bool = False) -> tuple[int, str]:
        """(id, prefix-cache key) of a request's adapter, read and checked the first time
        (ValueError naming the adapter and what does not fit). revive (add_lora): a removed id
        may be named again, as a new adapter."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a pagedjax.LoRARequest, got "
                             f"{type(lora).__name__}")
        if lora.lora_int_id in self.removed:
            if not revive:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} (lora_int_id "
                                 f"{lora.lora_int_id}) was unloaded; load it again to use it")
            self._revive(lora)
        known = self.adapters.get(lora.lora_int_id)
        if known is not None and (known.lora_name, known.lora_path) != (lora.lora_name,
                                                                        lora.lora_path):
            raise ValueError(f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r} "
                             f"({known.lora_path}); a request named it as {lora.lora_name!r} "
                             f"({lora.lora_path})")
        other = self.ids.get(lora.lora_name)
        if other is not None and other != lora.lora_int_id:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} has lora_int_id {other}, "
                             f"not {lora.lora_int_id}")
        if lora.lora_int_id not in self.host:
            self._cache(lora.lora_int_id, self._read(lora))
        else:
            self.host.move_to_end(lora.lora_int_id)
        self.adapters.setdefault(lora.lora_int_id, lora)
        self.ids[lora.lora_name] = lora.lora_int_id
        self.versions.setdefault(lora.lora_int_id, 0)
        return lora.lora_int_id, self.key(lora.lora_int_id)

    def _revive(self, lora: LoRARequest) -> None:
        """A removed id named again by add_lora: a new adapter (read afresh, a new version)."""
        lora_id = lora.lora_int_id
        self._cache(lora_id, self._read(lora))  # read first: a bad adapter changes nothing
        self.removed.discard(lora_id)
        self.adapters[lora_id] = lora
        self.versions[lora_id] = self.versions.get(lora_id, 0) + 1

    def knows(self, lora_id: int) -> bool:
        """Whether requests may name the adapter (read, and not removed since)."""
        return lora_id in self.adapters and lora_id not in self.removed

    def key(self, lora_id: int) -> str:
        """The adapter's part of its requests' block hashes: name, id and weights' version."""
        return (f"{self.adapters[lora_id].lora_name}\x00{lora_id}\x00"
                f"{self.versions[lora_id]}")

    def _read(self, lora: LoRARequest) -> dict:
        adapter = read_peft_adapter(lora.lora_path, self.model_config, self.spec.max_rank)
        self.num_reads += 1
        self.shapes[lora.lora_int_id] = (adapter.rank, adapter.scaling, adapter.target_modules)
        return self.host_arrays(adapter)

    def host_arrays(self, adapter: LoRAAdapter) -> dict:
        missing = sorted(set(adapter.pairs) - set(self.spec.modules))
        if missing:
            raise ValueError(f"LoRA adapter {adapter.path}: target_modules {missing} are not "
                             f"served for this model (it adapts {list(self.spec.modules)})")
        return self.spec.host_arrays(adapter)

    def _cache(self, lora_id: int, arrays: dict) -> None:
        self.host[lora_id] = arrays
        self.host.move_to_end(lora_id)
        while len(self.host) > self.max_cpu_loras:
            victim = next((i for i in self.host if i not in self.pinned), None)
            if victim is None:
                break
            del self.host[victim]

    def arrays(self, lora_id: int) -> dict:
        """The adapter's host arrays, read again from its path when the cache let them go."""
        arrays = self.host.get(lora_id)
        if arrays is None:
            arrays = self._read(self.adapters[lora_id])
            self._cache(lora_id, arrays)
        else:
            self.host.move_to_end(lora_id)
        return arrays

    def replace(self, lora_id: int, adapter: LoRAAdapter, pinned: bool) -> dict:
        """New weights for a known adapter (checked, then its host arrays replaced and its
        version bumped: its requests' block hashes change). pinned: held only here (not
        read from its path again), never let go by the host cache."""
        arrays = self.host_arrays(adapter)
        self.versions[lora_id] += 1
        (self.pinned.add if pinned else self.pinned.discard)(lora_id)
        self._cache(lora_id, arrays)
        self.shapes[lora_id] = (adapter.rank, adapter.scaling, adapter.target_modules)
        return arrays

    def forget(self, lora_id: int, in_use: bool) -> None:
        """No new request may name the adapter (its id, or its name until loaded again); its
        host arrays go unless requests use it."""
        name = self.adapters[lora_id].lora_name
        if self.ids.get(name) == lora_id:
            del self.ids[name]
        self.removed.add(lora_id)
        self.pinned.discard(lora_id)
        if not in_use:
            self.host.pop(lora_id, None)

    def stats(self, state) -> dict:
        """The adapters a scheduler state runs and holds waiting (names, as vLLM's
        lora_requests_info), its slots and the loads so far."""
        def names(requests):
            return sorted({self.adapters[r.lora_id].lora_name for r in requests
                           if r.lora_id is not None})

        slots = state.lora_slots
        return {"running": names(state.running), "waiting": names(state.waiting),
                "max_lora": slots.max_loras, "resident": len(slots.slot_of),
                "slot_loads": self.num_slot_loads, "evictions": slots.num_evictions,
                "load_seconds": self.load_time_s, "reads": self.num_reads}

    def load(self, runner, loads) -> None:
        """Writes the scheduler's (slot, adapter id) loads into the runner's slots."""
        for slot, lora_id in loads:
            start = time.perf_counter()
            runner.write_lora_slot(slot, self.arrays(lora_id))
            self.load_time_s += time.perf_counter() - start
            self.num_slot_loads += 1
