"""Data parallelism: replicas of the model on disjoint device groups, one engine in front.

    engine = make_engine(model, EngineConfig(data_parallel_size=2, tensor_parallel_size=2))

Each replica is an LLMEngine on its own tensor_parallel_size devices (row r of one ("dp", "tp")
mesh over jax.devices()) with its own KV pool and its own scheduler, as vLLM's data-parallel
engine cores are. A request lives on one replica: the one pagedjax.parallel.routing_policy's prefix-
affinity rule picks (the router's rule, over the prompt's block-sized chunks: the replica whose
prefix cache most likely holds the prompt's head, unless the replicas' loads are out of
balance). A step begins every replica's device step before finishing any (JAX dispatches
asynchronously), so the replicas' devices work at the same time; a replica whose step fails
beyond one request fails its own requests and starts over, the others go on.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import Callable, Sequence

import jax
import numpy as np

from pagedjax.engine import memory_budget
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import EngineOutput
from pagedjax.engine.request_checks import Admission, PromptSpec, check_specs
from pagedjax.engine.stats import EngineStats, ReplicaLoad
from pagedjax.frontend.data_parallel_pooling import DataParallelPooling
from pagedjax.lora.engine_loras import DataParallelLoRA
from pagedjax.parallel.routing_policy import Backend, RoutingPolicy
from pagedjax.parallel.sharding import check_tensor_parallel, make_data_parallel_mesh
from pagedjax.scheduler import SamplingParams
from pagedjax.scheduler.block_hash import token_block_hashes

# Summed over replicas; the peaks and max_running are the sums of each replica's (an upper
# bound of the engine's: the replicas peak at different times).
_SUMMED = [f.name for f in dataclasses.fields(EngineStats)
           if f.name not in ("block_size", "spec_accepted_per_position", "kv_tiers", "loras")]


def make_engine(model, config: EngineConfig | None = None, **kwargs):
    """An LLMEngine, or a DataParallelEngine when config.data_parallel_size > 1."""
    config = config or EngineConfig()
    if config.data_parallel_size > 1:
        return DataParallelEngine(model, config, **kwargs)
    return LLMEngine(model, config, **kwargs)


class DataParallelEngine(DataParallelLoRA, DataParallelPooling):
    """LLMEngine's interface over config.data_parallel_size replicas (see the module doc)."""

    def __init__(self, model, config: EngineConfig, *, tokenizer=None,
                 clock: Callable[[], float] = time.perf_counter, devices: Sequence | None = None,
                 draft_model=None):
        dp, tp = config.data_parallel_size, config.tensor_parallel_size
        # Given devices are counted by the mesh (a device may be named twice: replicas sharing
        # one chip, as the fast tests run them).
        check_tensor_parallel(model.config, tp, check_devices=devices is None,
                              data_parallel_size=dp)
        if jax.process_count() > 1:
            raise ValueError(f"data_parallel_size ({dp}) in a multi-process run: run a "
                             f"process group a replica, behind `pagedjax router`")
        self.mesh = make_data_parallel_mesh(dp, tp, devices)
        self.config = config
        self.model_config = model.config
        self.tokenizer = tokenizer
        self.clock = clock
        one = dataclasses.replace(config, data_parallel_size=1)
        seeds = np.random.SeedSequence(config.seed).spawn(dp)  # distinct sampling streams
        self.replicas = [LLMEngine(model, _replica_config(one, r), tokenizer=tokenizer,
                                   clock=clock, devices=list(self.mesh.devices[r]),
                                   seed_rng=np.random.default_rng(seeds[r]),
                                   draft_model=draft_model)
                         for r in range(dp)]
        if config.enable_lora:  # one set of adapters (ids, host cache, versions), each
            for replica in self.replicas[1:]:  # replica its own device slots
                replica.lora_manager = self.replicas[0].lora_manager
        self._backends = [Backend(f"replica:{r}", lookup=replica.cached_prefix_blocks)
                          for r, replica in enumerate(self.replicas)]
        self.policy = RoutingPolicy(self._backends, "kv_aware")
        self._next_id = 0

    # ---- what LLMEngine has ------------------------------------------------------------------

    @property
    def request_groups(self) -> collections.ChainMap:
        """request_id -> its samples, for every unfinished request of every replica."""
        # read only, as each replica's (ChainMap's type asks for mutable maps)
        return collections.ChainMap(*(r.request_groups  # type: ignore[arg-type]
                                      for r in self.replicas))

    def scheduler_states(self) -> list:
        return [r.scheduler.state for r in self.replicas]

    @property
    def token_masks(self):
        """Where admission checks and compiles constraints (the same for every replica; each
        keeps its own samples' states)."""
        return self.replicas[0].token_masks

    @property
    def buckets(self):
        return self.replicas[0].buckets

    @property
    def num_blocks(self) -> int:
        """Physical blocks of each replica's pool (the null block included)."""
        return self.replicas[0].num_blocks

    @property
    def bytes_per_block(self) -> int:
        return self.replicas[0].bytes_per_block

    @property
    def compilation_cache_dir(self):
        return self.replicas[0].compilation_cache_dir

    @property
    def stats(self) -> EngineStats:
        """Every replica's counters summed (replica_stats has each)."""
        total = EngineStats(block_size=self.config.block_size)
        for stats in self.replica_stats:
            for name in _SUMMED:
                setattr(total, name, getattr(total, name) + getattr(stats, name))
        per_position = [s.spec_accepted_per_position for s in self.replica_stats]
        total.spec_accepted_per_position = tuple(
            sum(p[j] for p in per_position if j < len(p))
            for j in range(max(map(len, per_position), default=0)))
        for stats in self.replica_stats:  # each replica's tiers, summed tier by tier
            for tier, counts in stats.kv_tiers.items():
                summed = total.kv_tiers.setdefault(tier, {})
                for name, value in counts.items():
                    summed[name] = summed.get(name, 0) + value
            for name, value in stats.loras.items():  # adapter names joined, counts summed
                before = total.loras.get(name)
                total.loras[name] = (value if before is None else sorted({*before, *value})
                                     if isinstance(value, list) else before + value)
        return total

    @property
    def replica_stats(self) -> list[EngineStats]:
        return [r.stats for r in self.replicas]

    def blocks_for(self, num_tokens: int) -> int:
        return self.replicas[0].blocks_for(num_tokens)

    @property
    def hybrid_kv_cache(self) -> bool:
        return self.replicas[0].hybrid_kv_cache

    @property
    def held_memory(self) -> tuple[int, int]:
        """(weights, KV pool) bytes over every replica's devices."""
        return memory_budget.held_memory(self)

    @property
    def memory_budget(self):
        """How the first replica's KV pool was sized (each replica sizes its own alike)."""
        return self.replicas[0].memory_budget

    def load(self) -> list[ReplicaLoad]:
        return [load for r in self.replicas for load in r.load()]

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def add_requests(self, specs: Sequence[PromptSpec],
                     admit: Callable[[list[Admission]], None] | None = None) -> list[str]:
        """LLMEngine.add_requests: checked all or none, then each placed on a replica."""
        for replica in self.replicas:
            replica.check_awake()
        admissions = check_specs(self, specs)
        if admit is not None:
            admit(admissions)
        taken = {a.request_id for a in admissions}
        groups: list[list[Admission]] = [[] for _ in self.replicas]
        ids = []
        for admission in admissions:
            request_id = admission.request_id
            if request_id is None:
                request_id = self._new_id(taken)
                admission = dataclasses.replace(admission, request_id=request_id)
            groups[self._place(admission, [len(g) for g in groups])].append(admission)
            ids.append(request_id)
        for replica, group in zip(self.replicas, groups):
            if group:
                replica.queue_admitted(group)
        return ids

    def add_request(self, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, lora_request=None) -> str:
        spec = PromptSpec(prompt_token_ids, sampling_params or SamplingParams(), request_id,
                          cache_salt=cache_salt, arrival_time=arrival_time,
                          lora_request=lora_request)
        return self.add_requests([spec])[0]

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            if request_id in replica.request_groups:
                replica.abort(request_id)

    def step(self, final_only: bool = False) -> list[EngineOutput]:
        """One step of every replica with work: all dispatched, then all finished. A replica
        whose step fails beyond one request (LLMEngine.step raises) fails its requests alone
        (LLMEngine.fail_all) and starts over."""
        outputs: list[EngineOutput] = []  # what pausing a replica produced first
        for replica in self.replicas:
            outputs.extend(replica.take_held_outputs(final_only))
        started = []
        for replica in self.replicas:
            try:
                started.append(None if replica.is_paused else _begin(replica))
            except Exception as error:  # noqa: BLE001 - that replica alone
                started.append(error)
        for replica, begun in zip(self.replicas, started):
            try:
                if isinstance(begun, Exception):
                    raise begun
                outputs.extend(_finish(replica, begun, final_only))
            except Exception as error:  # noqa: BLE001 - that replica alone
                outputs.extend(replica.fail_all(error))
        return outputs

    def fail_all(self, error: BaseException) -> list[EngineOutput]:
        return [out for r in self.replicas for out in r.fail_all(error)]

    def warmup(self, progress: bool = False, variants: bool = True) -> int:
        """Every replica's step programs (a program is compiled for its replica's devices)."""
        return sum(r.warmup(progress, variants) for r in self.replicas)

    def start_warmup(self, progress: bool = False, variants: bool = True) -> "_Warmups":
        return _Warmups([r.start_warmup(progress, variants) for r in self.replicas])

    @property
    def num_compiled_programs(self) -> int:
        return sum(r.num_compiled_programs for r in self.replicas)

    # ---- training to serving (pagedjax.engine.weight_updates): every replica alike ----------

    def update_weights(self, weights, *, version: str | None = None, mode: str = "wait") -> None:
        for replica in self.replicas:  # each checks the weights before it changes anything
            replica.update_weights(weights, version=version, mode=mode)

    def pause_generation(self, mode: str = "wait") -> None:
        for replica in self.replicas:
            replica.pause_generation(mode)

    def resume_generation(self) -> None:
        for replica in self.replicas:
            replica.resume_generation()

    def hold_new_requests(self) -> None:
        for replica in self.replicas:
            replica.hold_new_requests()

    def release_new_requests(self) -> None:
        for replica in self.replicas:
            replica.release_new_requests()

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def has_work(self) -> bool:
        return any(r.has_work for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        if any(r.scheduler.kv_manager.num_used_blocks for r in self.replicas):
            return False
        return all([r.reset_prefix_cache() for r in self.replicas])

    def sleep(self, level: int = 1) -> None:
        for replica in self.replicas:
            replica.sleep(level)

    def wake_up(self, tags=None) -> None:
        for replica in self.replicas:
            replica.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.replicas[0].is_sleeping

    @property
    def weight_version(self) -> str:
        return self.replicas[0].weight_version

    @property
    def is_paused(self) -> bool:
        return self.replicas[0].is_paused

    # ---- placement ---------------------------------------------------------------------------

    def _place(self, admission: Admission, pending: list[int]) -> int:
        """The replica for a request, by the prefix-affinity rule (loads: unfinished requests,
        and pending[r] placed on replica r by this call already); its prompt's chunks are
        recorded there. Chunks are the prompt's KV blocks' chained hashes (the salt in them, as
        in the prefix cache), so a replica answers for what any tier of its prefix cache holds
        (LLMEngine.cached_prefix_blocks) beside the policy's picture of what it was sent."""
        chunks = token_block_hashes(admission.prompt_token_ids, self.config.block_size,
                                    self.replicas[0].scheduler.kv_manager.cache_key,
                                    admission.spec.cache_salt,
                                    admission.lora[1] if admission.lora else None)
        for backend, replica, placed in zip(self._backends, self.replicas, pending):
            backend.in_flight = len(replica.request_groups) + placed
        backend, _ = self.policy.choose(chunks)
        self.policy.record(backend, chunks)
        return self._backends.index(backend)

    def _new_id(self, taken: set) -> str:
        groups = self.request_groups
        while (request_id := str(self._next_id)) in groups or request_id in taken:
            self._next_id += 1
        self._next_id += 1
        taken.add(request_id)
        return request_id


def _replica_config(config: EngineConfig, replica: int) -> EngineConfig:
    """A replica's config: its disk tier in a directory of its own (of kv_disk_bytes; each
    replica's index is then the whole of what its directory holds)."""
    if config.kv_disk_dir is None:
        return config
    return dataclasses.replace(config, kv_disk_dir=os.path.join(config.kv_disk_dir,
                                                                f"replica-{replica}"))


def _begin(replica: LLMEngine):
    """A replica's step dispatched (with async scheduling, the one after it too)."""
    if replica.async_scheduling is not None:
        return replica.async_scheduling.begin()
    return replica.begin_step() if replica.has_unfinished() else None


def _finish(replica: LLMEngine, begun, final_only: bool) -> list[EngineOutput]:
    if replica.async_scheduling is not None:
        return replica.async_scheduling.finish(begun, final_only)
    return replica.finish_step(begun, final_only)


class _Warmups:
    """Each replica's BackgroundWarmup, as one (done, wait, error, seconds, num_programs)."""

    def __init__(self, warmups):
        self._warmups = warmups
        self.num_programs = sum(w.num_programs for w in warmups)

    def done(self) -> bool:
        return all(w.done() for w in self._warmups)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for w in self._warmups:
            w.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.done()

    @property
    def error(self) -> BaseException | None:
        return next((w.error for w in self._warmups if w.error is not None), None)

    @property
    def seconds(self) -> float | None:
        times = [w.seconds for w in self._warmups]
        return None if None in times else max(times)
