"""Training-to-serving controls of a running engine (issue 52; vLLM's pause_generation /
update_weights / reset_prefix_cache, SGLang's update_weights_from_tensor): new weights taken in
place between two steps, generation paused and resumed, and the weights' version recorded with
every output.

Pausing settles the step in flight (async scheduling) and then, by mode:

- `wait`: the requests in flight (scheduled at least once) run to the end on the current
  weights; requests that never ran wait, and start after the pause ends;
- `abort`: every unfinished request ends now with finish_reason "abort";
- `keep`: everything stops where it is; the requests keep their KV blocks and go on when the
  pause ends (after an update: on the new weights, over KV the old ones computed; off-policy).

Outputs produced while pausing (the `wait` drain, the aborts) are returned by the next step().
While paused, step() schedules nothing.

No stale KV: the weights' version is part of the prefix cache's key (the root of every block's
chained hash), so a block computed by other weights is never a hit again, on the device, in the
host tier or on disk; the old blocks age out like any other. Requests that had not run keep no
hash computed under the old key. A `keep` request goes on publishing its blocks under the key it
started with: no request admitted after the update can hit them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax.numpy as jnp
from flax import nnx

from pagedjax.engine.named_weights import named_parts
from pagedjax.engine.new_weights import check_checkpoint, model_of, model_parts, prepared
from pagedjax.engine.weight_writer import write_parts
from pagedjax.kv_offload.tiers import disk_key
from pagedjax.models.loading.lazy_model import LazyModel
from pagedjax.scheduler import RequestStatus

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine

PAUSE_MODES = ("abort", "wait", "keep")
MAX_VERSION_CHARS = 256


def _check_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")


class WeightUpdates:
    """LLMEngine's weight updates, pausing and versions, a part of the engine (engine.weights):
    it owns the weights' version, the pause and the outputs pausing produced, and writes new
    weights through the runner's methods."""

    def __init__(self, engine: LLMEngine, model):
        self.engine = engine
        self._weights_origin = id(model)  # the prefix cache's key names the weights by it
        self.weight_version = "0"  # the caller's name for the weights served, or a counter
        self.num_weight_updates = 0
        self.is_paused = False
        self._held_outputs: list = []  # produced while pausing, returned by the next step()
        self.holding_new = False  # requests that never ran are left waiting (a `wait` pause)

    @property
    def has_held_outputs(self) -> bool:
        return bool(self._held_outputs)

    def pause_generation(self, mode: str = "wait") -> None:
        """Pauses generation (the module's docstring); a paused engine pauses again as asked
        (`wait` drains what is in flight, `abort` ends what is unfinished)."""
        _check_mode(mode)
        held = self._settle_in_flight()
        if mode == "abort":
            held += self._abort_unfinished()
        elif mode == "wait":
            held += self._drain_in_flight()
        self._held_outputs.extend(held)
        self.is_paused = True

    def resume_generation(self) -> None:
        self.is_paused = self.holding_new = False

    def hold_new_requests(self) -> None:
        """A `wait` pause that does not block: the steps go on for the requests in flight only
        (num_in_flight counts them down); requests that never ran wait until
        resume_generation or release_new_requests. (A server drains so, streaming meanwhile.)"""
        self.holding_new = True

    def release_new_requests(self) -> None:
        self.holding_new = False

    @property
    def has_work(self) -> bool:
        """Whether step() would do anything: outputs to return, or requests it may schedule
        (none while paused; only those in flight while new ones are held)."""
        if self._held_outputs:
            return True
        if self.is_paused:
            return False
        return bool(self.num_in_flight if self.holding_new
                    else self.engine.scheduler.has_unfinished())

    @property
    def num_in_flight(self) -> int:
        """Unfinished requests that have run (scheduled at least once)."""
        return sum(1 for request in self.engine.scheduler.state.requests.values()
                   if request.first_scheduled_time is not None)

    def take_held_outputs(self, final_only: bool) -> list:
        """The outputs pausing produced (step() returns them first; final_only: the finished
        ones)."""
        if not self._held_outputs:
            return []
        held, self._held_outputs = self._held_outputs, []
        return [o for o in held if o.finished] if final_only else held

    def update_weights(self, weights, *, version: str | None = None, mode: str = "wait") -> None:
        """Serves new weights from the next step on: a model of the engine's config or its
        nnx.State (new_weights), Hugging Face-named arrays (named_weights), or a checkpoint
        read into place (a LazyModel: LLM.update_weights(path); the only kind a multi-host
        engine takes). Checked before anything changes (ValueError naming the leaf); the
        requests in flight as `mode` says; version: the weights' name (default: the number of
        updates so far)."""
        _check_mode(mode)
        if version is not None and (not isinstance(version, str) or not version
                                    or len(version) > MAX_VERSION_CHARS):
            raise ValueError(f"version must be a non-empty string of at most "
                             f"{MAX_VERSION_CHARS} characters, got {version!r:.80}")
        engine = self.engine
        if isinstance(weights, LazyModel):  # a checkpoint, read into place
            lazy = prepared(weights, engine.config.quantization, engine.config.quantize_lm_head)
            check_checkpoint(lazy, engine.runner)
            self._updating(mode, version, lambda: self._place_checkpoint(lazy))
            return
        if engine.multihost:
            raise ValueError("weights: a multi-host engine takes new weights as a checkpoint "
                             "path (every process reads its own devices' shards of it), not "
                             f"as {type(weights).__name__}")
        parts, repeats = self._new_parts(weights)
        self._updating(mode, version, lambda: self._write_weights(parts, repeats))

    def _updating(self, mode: str, version: str | None, write) -> None:
        """Pauses as mode says, write()s the new weights, names them, and resumes."""
        was_paused = self.is_paused
        self.pause_generation(mode)
        try:
            write()
            self.num_weight_updates += 1
            self.weight_version = str(self.num_weight_updates) if version is None else version
            self._rekey_prefix_cache()
        finally:
            if not was_paused:
                self.resume_generation()

    def _place_checkpoint(self, lazy) -> None:
        """A checkpoint read straight into the served leaves' shardings (each process its own
        shards; multi-host, the followers told first), once the old weights are let go: never
        two copies. A read that fails leaves the weights asleep until an update succeeds."""
        runner, sleep = self.engine.runner, self.engine.sleep_mode
        if runner.channel is not None:
            runner.channel.update_weights(str(lazy.source))
        sleep.weights_for_update()
        specs = runner.weight_specs
        runner.set_params(None)
        try:
            runner.set_params(lazy.place(specs, lambda path, leaf: leaf.sharding),
                              borrowed=frozenset())
        except Exception:  # noqa: BLE001 - re-raised; no whole weights on the device
            sleep.weights_lost()
            raise
        sleep.weights_awake()

    def _new_parts(self, weights) -> tuple[dict, dict]:
        """The served leaves' parts of weights (a model, its nnx.State, or HF-named arrays),
        checked."""
        engine = self.engine
        if isinstance(weights, Mapping) and not isinstance(weights, nnx.State):
            parts, repeats, whole = named_parts(weights, engine.runner, engine.model_config,
                                                engine.config.quantization)
            if not whole and "weights" in engine.sleep_mode.asleep:
                raise ValueError("weights: a partial update (some of the model's names) needs "
                                 "the weights awake (they sleep: wake_up first, or give every "
                                 "weight, or a model)")
            return parts, repeats
        model = prepared(model_of(weights, engine.model_config, jnp.dtype(engine.config.dtype)),
                         engine.config.quantization, engine.config.quantize_lm_head)
        return model_parts(model, engine.runner, engine.model_config)

    def _write_weights(self, parts: dict, repeats: dict) -> None:
        """parts (checked) written into the served weights (pagedjax.engine.weight_writer);
        asleep, written anew where they were. A write that fails part way leaves no whole
        weights on the device: they sleep until an update succeeds."""
        engine, sleep = self.engine, self.engine.sleep_mode
        sleep.weights_for_update()
        try:
            write_parts(engine.runner, parts, repeats, engine.model_config.num_kv_heads)
        except Exception:  # noqa: BLE001 - re-raised; the weights are not whole
            sleep.weights_lost()
            raise
        sleep.weights_awake()  # new weights wake them, if they slept

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block, on the device and in the host tier (the disk tier's files
        stay: they are keyed by the weights): False, and nothing done, while requests hold
        blocks (as vLLM)."""
        engine = self.engine
        kv = engine.scheduler.kv_manager
        if kv.num_used_blocks:
            return False
        if engine.kv_tiers is not None:
            engine.kv_tiers.flush()
        kv.drop_cached_content()
        if kv.host_tier is not None:
            kv.host_tier.clear()
        return True

    # ---- internals ------------------------------------------------------------------------------

    def _settle_in_flight(self) -> list:
        """Finishes the step async scheduling dispatched ahead (its outputs)."""
        scheduling = self.engine.async_scheduling
        return [] if scheduling is None else scheduling.settle()

    def _abort_unfinished(self) -> list:
        engine = self.engine
        now, outputs = engine.clock(), []
        for parent_id in list(engine.requests):
            for sample in engine.requests[parent_id].samples:
                if not sample.status.finished:
                    engine.scheduler.abort(sample.request_id, now)
            engine.stats.num_aborted += 1
            outputs.append(engine.outputs.request_output(parent_id))
        return outputs

    def _drain_in_flight(self) -> list:
        """Steps until every request that has run finishes (the others held: step_schedule)."""
        outputs, holding = [], self.holding_new
        self.holding_new = True
        try:
            while self.num_in_flight:
                outputs += self.engine.finish_step(self.engine.begin_step())
        finally:
            self.holding_new = holding
        return outputs

    def _rekey_prefix_cache(self) -> None:
        """A new prefix-cache key for the weights now served (the module's docstring)."""
        engine = self.engine
        tiers = engine.kv_tiers
        if tiers is not None and tiers.disk is not None:  # other processes find them by this
            tiers.disk.key = disk_key(engine.runner, engine.config)
        engine.scheduler.kv_manager.cache_key = self.cache_key()
        for request in list(engine.scheduler.state.waiting):  # not running: the new key's
            for sample in [request, *request.followers]:
                if sample.status is not RequestStatus.RUNNING:
                    sample.block_hashes = []

    def cache_key(self) -> bytes:
        """What a cached block's KV depends on besides its tokens: the model's architecture, its
        weights (the model the engine was built from, by identity, and the updates since; with a
        disk tier, which other processes read, the weights' fingerprint), the dtypes."""
        engine = self.engine
        tiers = engine.kv_tiers
        weights = (tiers.disk.key if tiers is not None and tiers.disk is not None
                   else (self._weights_origin, self.num_weight_updates))
        return repr((engine.model_config, weights, engine.config.dtype,
                     engine.config.kv_cache_dtype)).encode()
