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

from typing import TYPE_CHECKING

import jax

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine

SLEEP_LEVELS = (1, 2)


class EngineAsleepError(RuntimeError):
    """A request for a sleeping engine (a server answers 503, code engine_asleep)."""

TAGS = ("weights", "kv_cache")


class SleepMode:
    """LLMEngine's sleep and wake-up, a part of the engine (engine.sleep_mode): it owns which
    parts are off the device and the host copy of the weights, and changes the runner through
    its methods."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.level = 0  # the sleep level (0: awake)
        self.asleep: set[str] = set()  # the parts off the device
        self._host_weights = None  # level 1: the weights in host memory (NumPy)
        self._weights_spec = None  # the weights' shapes, dtypes and shardings, while asleep

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def check_awake(self) -> None:
        """EngineAsleepError naming the sleep while any part of the engine sleeps."""
        if self.asleep:
            raise EngineAsleepError(f"the engine is asleep (sleep level {self.level}, "
                                    f"{' and '.join(sorted(self.asleep))} off the device): "
                                    f"wake_up() first")

    def sleep(self, level: int = 1) -> None:
        if level not in SLEEP_LEVELS or isinstance(level, bool):
            raise ValueError(f"level must be 1 (weights to host memory, KV pool dropped) or 2 "
                             f"(both dropped), got {level!r}")
        if self.asleep:
            raise ValueError(f"the engine is already asleep (level {self.level})")
        engine = self.engine
        if engine.scheduler.has_unfinished() or engine.weights.has_held_outputs:
            raise ValueError("sleep needs an idle engine: requests are unfinished (let them "
                             "finish, or pause_generation('abort') first)")
        runner = engine.runner
        self._weights_spec = runner.weight_specs
        self._host_weights = jax.device_get(runner.params) if level == 1 else None
        # woken or new, the weights are the engine's own: none borrowed
        runner.set_params(None, borrowed=frozenset())
        runner.drop_kv_cache()
        engine.scheduler.kv_manager.drop_cached_content()  # the device blocks' content is gone
        self.asleep = set(TAGS)
        self.level = level

    def wake_up(self, tags=None) -> None:
        """Puts the parts named (default: both) back on the device."""
        tags = set(TAGS if tags is None else tags)
        if not tags <= set(TAGS):
            raise ValueError(f"tags must be among {list(TAGS)}, got {sorted(tags)}")
        runner = self.engine.runner
        if "weights" in tags & self.asleep:
            if self._host_weights is None:
                raise ValueError("sleep level 2 dropped the weights: update_weights(...) "
                                 "brings new ones (and wakes them)")
            runner.set_params(jax.tree.map(lambda host, spec: jax.device_put(
                host, spec.sharding), self._host_weights, self._weights_spec))
            self.weights_awake()
        if "kv_cache" in tags & self.asleep:
            runner.restore_kv_cache()
            self.asleep.discard("kv_cache")
        if not self.asleep:
            self.level = 0

    def weights_awake(self) -> None:
        """New or restored weights are on the device."""
        self._host_weights = self._weights_spec = None
        self.asleep.discard("weights")
        if not self.asleep:
            self.level = 0

    def weights_lost(self) -> None:
        """After a write that failed part way: the weights sleep (level 2) until an update
        succeeds (requests are refused by name meanwhile)."""
        runner = self.engine.runner
        self._weights_spec = runner.weight_specs
        self.asleep.add("weights")
        self.level = self.level or 2
        runner.set_params(None)

    def weights_for_update(self) -> None:
        """Before new weights are placed: the host copy is let go, and while the weights sleep
        their specs stand for them (update_weights places the new leaves where they were)."""
        self._host_weights = None
        if "weights" in self.asleep:
            self.engine.runner.set_params(self._weights_spec)
