"""Sleep mode (issue 52; vLLM's LLM.sleep / wake_up, SGLang's release / resume_memory_occupation):
an idle engine gives its device memory back while a trainer uses the chips, and takes it again
without being rebuilt: nothing reloads from disk and nothing recompiles (the arrays come back
with the shapes, dtypes and shardings the programs were compiled for).

- `sleep(level=1)`: the weights are copied to host memory, then the device's weights and KV
  pool are dropped (the prefix cache's device blocks with them; the host and disk tiers keep
  theirs);
- `sleep(level=2)`: both dropped; the weights come back with update_weights (a trainer's new
  ones), which wakes them;
- `wake_up(tags=("weights", "kv_cache"))`: each part named back on the device (the KV pool
  zeroed, empty).

While any part sleeps, new requests are refused (EngineAsleepError, naming the sleep; 503 from
a server). (A model the caller still holds keeps
its own arrays: dropping the engine's references frees only what the engine alone held.)
"""

from __future__ import annotations

import jax

SLEEP_LEVELS = (1, 2)


class EngineAsleepError(RuntimeError):
    """A request for a sleeping engine (a server answers 503, code engine_asleep)."""

TAGS = ("weights", "kv_cache")


class SleepMode:
    """LLMEngine's sleep and wake-up (a mixin over its runner and scheduler)."""

    def _init_sleep_mode(self) -> None:
        self.sleep_level = 0
        self._asleep: set[str] = set()  # the parts off the device
        self._host_weights = None  # level 1: the weights in host memory (NumPy)
        self._weights_spec = None  # the weights' shapes, dtypes and shardings, while asleep

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def check_awake(self) -> None:
        """EngineAsleepError naming the sleep while any part of the engine sleeps."""
        if self._asleep:
            raise EngineAsleepError(f"the engine is asleep (sleep level {self.sleep_level}, "
                             f"{' and '.join(sorted(self._asleep))} off the device): "
                             f"wake_up() first")

    def sleep(self, level: int = 1) -> None:
        if level not in SLEEP_LEVELS or isinstance(level, bool):
            raise ValueError(f"level must be 1 (weights to host memory, KV pool dropped) or 2 "
                             f"(both dropped), got {level!r}")
        if self._asleep:
            raise ValueError(f"the engine is already asleep (level {self.sleep_level})")
        if self.scheduler.has_unfinished() or self._held_outputs:
            raise ValueError("sleep needs an idle engine: requests are unfinished (let them "
                             "finish, or pause_generation('abort') first)")
        runner = self.runner
        self._weights_spec = runner.weight_specs
        self._host_weights = jax.device_get(runner.params) if level == 1 else None
        runner.params = runner.kv_cache = None
        runner.borrowed = frozenset()  # woken or new, the weights are the engine's own
        self.scheduler.kv_manager.drop_cached_content()  # the device blocks' content is gone
        self._asleep = set(TAGS)
        self.sleep_level = level

    def wake_up(self, tags=None) -> None:
        """Puts the parts named (default: both) back on the device."""
        tags = set(TAGS if tags is None else tags)
        if not tags <= set(TAGS):
            raise ValueError(f"tags must be among {list(TAGS)}, got {sorted(tags)}")
        if "weights" in tags & self._asleep:
            if self._host_weights is None:
                raise ValueError("sleep level 2 dropped the weights: update_weights(...) "
                                 "brings new ones (and wakes them)")
            self.runner.params = jax.tree.map(lambda host, spec: jax.device_put(
                host, spec.sharding), self._host_weights, self._weights_spec)
            self._weights_awake()
        if "kv_cache" in tags & self._asleep:
            self.runner.kv_cache = self.runner._new_kv_cache()
            self._asleep.discard("kv_cache")
        if not self._asleep:
            self.sleep_level = 0

    def _weights_awake(self) -> None:
        self._host_weights = self._weights_spec = None
        self._asleep.discard("weights")
        if not self._asleep:
            self.sleep_level = 0

    def _served_weights_for_update(self) -> None:
        """Before new weights are placed: while the weights sleep, their specs stand for them
        (update_weights places the new leaves where they were)."""
        if "weights" in self._asleep:
            self.runner.params = self._weights_spec
