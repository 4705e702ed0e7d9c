"""Multi-host serving on JAX's multi-controller runtime: one model over every process's devices.

    # every process (Cloud TPU: no arguments, jax.distributed reads the environment)
    pagedjax serve MODEL --coordinator 10.0.0.1:1234 --num-processes 2 --process-id I \\
        --tensor-parallel-size 8

Every process calls `initialize` (jax.distributed.initialize; on CPU with gloo collectives),
then builds the same engine: the mesh spans all processes' devices (jax.devices() is global)
and each process reads and holds only its own devices' shards of the weights and the KV cache
(models.placed_weights: make_array_from_callback calls back for addressable devices only).

Process 0, the leader, runs the scheduler, the server and every other piece of host state;
the others, followers, hold no requests at all: they are the runner's other hands. Each time
the leader's runner starts a step program it first broadcasts the step to the followers with
`jax.experimental.multihost_utils.broadcast_one_to_all` (a collective over the processes'
devices, no side channel): a fixed-size header (what to do and the program's shape) and then
the BatchPlan's arrays, whose shapes the header gives. Every process then runs the same SPMD
program on its shards, in the same order. A plan is everything a step needs, so the followers
need neither the added nor the aborted requests. A failed step that lost the KV cache is
followed by a reset broadcast (every process reallocates its shards), and the leader's exit
by a stop.

A follower that dies fails the leader's next collective (gloo: the peer's connection closed)
or, failing that, JAX's coordination service reports the missing heartbeat after
`heartbeat_timeout_seconds` and stops every process: either way the leader ends with an error,
not a hang. Swap preemption is refused: its host pool would be split over the processes.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging

import jax
import numpy as np

from scheduler import ARRAY_FIELDS, DECODE, PREFILL

logger = logging.getLogger("pagedjax.multihost")

STEP, RESET, STOP = 1, 2, 3
KINDS = (DECODE, PREFILL)
HEADER = 8  # int32s: command, kind, T, B, max blocks per sequence, unused


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_seconds: int = 100) -> None:
    """jax.distributed.initialize (no arguments: from the environment, as on Cloud TPU); on CPU
    the collectives go over gloo. Call before anything touches a device."""
    if (coordinator is None) != (num_processes is None) or (
            num_processes is not None and process_id is None):
        raise ValueError("give coordinator, num_processes and process_id together (or none, "
                         "to read them from the environment)")
    if num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got "
                         f"{process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)


def is_multihost() -> bool:
    return jax.process_count() > 1


def check_multihost(config) -> None:
    """Raises ValueError naming the limit when an engine config cannot span the processes."""
    devices = jax.device_count()
    if config.tensor_parallel_size * config.data_parallel_size != devices:
        raise ValueError(f"multi-host serving needs tensor_parallel_size x data_parallel_size "
                         f"= every process's devices ({devices}), got "
                         f"{config.tensor_parallel_size} x {config.data_parallel_size}")
    if config.data_parallel_size != 1:
        raise ValueError("multi-host serving shards one model over all processes: "
                         "data_parallel_size must be 1 (run one group a replica)")
    if config.preemption_mode == "swap":
        raise ValueError("preemption_mode='swap' is single-host only (the host pool would be "
                         "split over the processes); use 'recompute'")


def _broadcast(tree):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=jax.process_index() == 0)


def _header(command: int, kind: str = DECODE, num_tokens: int = 0, num_seqs: int = 0,
            max_blocks: int = 0) -> np.ndarray:
    header = np.zeros(HEADER, np.int32)
    header[:5] = command, KINDS.index(kind), num_tokens, num_seqs, max_blocks
    return header


class LeaderChannel:
    """The leader's side: what its runner tells the followers before running a program."""

    def __init__(self):
        self.stopped = False
        atexit.register(self.stop)

    def step(self, plan) -> None:
        _broadcast(_header(STEP, plan.kind, plan.padded_num_tokens, plan.padded_num_seqs,
                           plan.block_tables.shape[1]))
        _broadcast({name: np.asarray(getattr(plan, name)) for name in ARRAY_FIELDS})

    def reset(self) -> None:
        _broadcast(_header(RESET))

    def stop(self) -> None:
        """Ends the followers' loops (once; at exit too)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            _broadcast(_header(STOP))
        except Exception as error:  # noqa: BLE001 - a follower already gone
            logger.warning("could not stop the followers: %s", error)


def follow(runner) -> int:
    """A follower's loop: runs every program the leader broadcasts, on this process's shards,
    until the leader stops; returns the number of steps run."""
    from pagedjax.runner import padding_plan

    steps = 0
    while True:
        header = np.asarray(_broadcast(_header(0)))
        command, kind, num_tokens, num_seqs, max_blocks = (int(x) for x in header[:5])
        if command == STOP:
            return steps
        if command == RESET:
            runner.reset_kv_cache()
            continue
        if command != STEP:
            raise RuntimeError(f"follower got an unknown command {command} from the leader")
        template = padding_plan(KINDS[kind], num_tokens, num_seqs, max_blocks)
        arrays = _broadcast({name: getattr(template, name) for name in ARRAY_FIELDS})
        plan = dataclasses.replace(template, **{k: np.asarray(v) for k, v in arrays.items()})
        runner.fetch(runner.dispatch(plan))
        steps += 1
