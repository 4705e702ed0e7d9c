"""Multi-host serving on JAX's multi-controller runtime: one model over every process's devices.

    # every process (Cloud TPU: no arguments, jax.distributed reads the environment)
    pagedjax serve MODEL --coordinator 10.0.0.1:1234 --num-processes 2 --process-id I \\
        --tensor-parallel-size 8

Every process calls `initialize` (jax.distributed.initialize; on CPU with gloo collectives),
then builds the same engine: the mesh spans all processes' devices (jax.devices() is global)
and each process reads and holds only its own devices' shards of the weights and the KV cache
(pagedjax.models.loading.placed_weights: make_array_from_callback calls back for addressable devices only).

Process 0, the leader, runs the scheduler, the server and every other piece of host state;
the others, followers, hold no requests at all: they are the runner's other hands. Each time
the leader's runner starts a step program it first broadcasts the step to the followers with
`jax.experimental.multihost_utils.broadcast_one_to_all` (a collective over the processes'
devices, no side channel): a fixed-size header (what to do and the program's shape) and then
the BatchPlan's arrays, whose shapes the header gives. Every process then runs the same SPMD
program on its shards, in the same order. A plan is everything a step needs, so the followers
need neither the added nor the aborted requests. A failed step that lost the KV cache is
followed by a reset broadcast (every process reallocates its shards), and the leader's exit
by a stop. The host tier of the prefix cache moves blocks between the cache and host memory
with the same announcements (BLOCKS: each process its own shards, to or from its own pool).

A follower that dies fails the leader's next collective (gloo: the peer's connection closed)
or, failing that, JAX's coordination service reports the missing heartbeat after
`heartbeat_timeout_seconds` and stops every process: either way the leader ends with an error,
not a hang. Swap preemption is refused: its host pool would be split over the processes.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from pagedjax.scheduler import DECODE, FORWARD_FIELDS, PREFILL

logger = logging.getLogger("pagedjax.parallel.multihost")

STEP, RESET, STOP, BLOCKS, UPDATE = 1, 2, 3, 4, 5
KINDS = (DECODE, PREFILL)
# int32s: command, kind, T, B, max blocks per sequence, prompt targets, the other KV cache
# groups' table width, speculative tokens, pooling rows
HEADER = 9


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_seconds: int = 100) -> None:
    """jax.distributed.initialize (no arguments: from the environment, as on Cloud TPU); on CPU
    the collectives go over gloo. Call before anything touches a device."""
    if (coordinator is None) != (num_processes is None) or (
            num_processes is not None and process_id is None):
        raise ValueError("give coordinator, num_processes and process_id together (or none, "
                         "to read them from the environment)")
    if num_processes is not None and process_id is not None \
            and not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got "
                         f"{process_id}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)


def check_multihost(config, devices) -> None:
    """Raises ValueError naming the limit when an engine over these devices (of several
    processes) cannot serve."""
    processes = {d.process_index for d in devices}
    if processes != set(range(jax.process_count())):
        raise ValueError(f"a model over several processes must span all {jax.process_count()} "
                         f"of them (every process runs each step); tensor_parallel_size "
                         f"{config.tensor_parallel_size} covers processes {sorted(processes)}")
    if config.gpu_memory_utilization is not None:
        raise ValueError("gpu_memory_utilization is single-host only (each process would size "
                         "its own pool); give num_blocks or kv_cache_memory_bytes")
    if config.preemption_mode == "swap":
        raise ValueError("preemption_mode='swap' is single-host only (the host pool would be "
                         "split over the processes); use 'recompute'")
    if config.kv_disk_dir is not None:
        raise ValueError("kv_disk_dir (the prefix cache's disk tier) is single-host only for "
                         "now (each process would read its own shards' files); the host tier "
                         "(kv_offload_bytes) works multi-host")


def add_args(parser) -> None:
    """`pagedjax serve`'s multi-host flags."""
    group = parser.add_argument_group("multi-host (jax.distributed; process 0 serves)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's address for jax.distributed (with --num-processes "
                       "and --process-id)")
    group.add_argument("--num-processes", type=int,
                       help="how many processes serve the model together")
    group.add_argument("--process-id", type=int,
                       help="this process's index, 0 (the leader, which serves) to N - 1")
    group.add_argument("--distributed", action="store_true",
                       help="jax.distributed.initialize() from the environment (Cloud TPU, "
                       "SLURM), no flags")
    group.add_argument("--heartbeat-timeout", type=int, default=100,
                       help="seconds before JAX's coordination service gives up on a silent "
                       "process")


def requested(args) -> bool:
    """The flags ask for several processes (jax.distributed)."""
    return args.distributed or any(f is not None for f in
                                   (args.coordinator, args.num_processes, args.process_id))


def start_from_args(args) -> bool:
    """Initializes jax.distributed when the flags ask; True when this process is a follower
    (it then runs `follow` instead of serving)."""
    flags = (args.coordinator, args.num_processes, args.process_id)
    if args.distributed and any(f is not None for f in flags):
        raise ValueError("--distributed reads the environment: give it without --coordinator "
                         "/ --num-processes / --process-id")
    if not requested(args):
        return False
    initialize(*flags, heartbeat_timeout_seconds=args.heartbeat_timeout)
    return jax.process_index() != 0


def _broadcast(tree):
    from jax.experimental import multihost_utils

    return multihost_utils.broadcast_one_to_all(tree, is_source=jax.process_index() == 0)


def _header(command: int, kind: str = DECODE, num_tokens: int = 0, num_seqs: int = 0,
            table_widths: tuple[int, int] = (0, 0), prompt_targets: int = 0,
            num_speculative_tokens: int = 0, pooling_rows: int = 0) -> np.ndarray:
    header = np.zeros(HEADER, np.int32)
    header[:] = (command, KINDS.index(kind), num_tokens, num_seqs, table_widths[0],
                 prompt_targets, table_widths[1], num_speculative_tokens, pooling_rows)
    return header


class GroupLostError(RuntimeError):
    """The processes are out of step (a follower died, or a step failed on some of them):
    nothing more can run; the group must be restarted."""


class LeaderChannel:
    """The leader's side: what its runner tells the followers before running a program. Any
    failure once a step was announced breaks the group for good (the processes no longer run
    the same programs): `error` is set and every later call raises it."""

    def __init__(self):
        self.stopped = False
        self.error: GroupLostError | None = None
        atexit.register(self.stop)

    def broken(self, cause: BaseException) -> GroupLostError:
        """Records that the group is lost because of cause; returns the error to raise."""
        if self.error is None:
            self.error = GroupLostError(
                f"the multi-host group is lost ({jax.process_count()} processes): a follower "
                f"died or a step failed on some processes: {type(cause).__name__}: {cause}"[:2000])
        return self.error

    def _send(self, tree) -> None:
        if self.error is not None:
            raise self.error
        try:
            _broadcast(tree)
        except Exception as cause:  # noqa: BLE001 - a peer is gone
            raise self.broken(cause) from cause

    def step(self, plan) -> None:
        self._send(_header(STEP, plan.kind, plan.padded_num_tokens, plan.padded_num_seqs,
                           plan.table_widths, plan.prompt_targets.shape[0],
                           plan.num_speculative_tokens, plan.pooling_rows.shape[0]))
        self._send({name: np.asarray(getattr(plan, name)) for name in FORWARD_FIELDS})

    def blocks(self, to_device: bool, device: list[int], host: list[int]) -> None:
        """A move of whole blocks between the cache and the host tier (block_transfers):
        every process moves its own shards, to or from its own host pool."""
        header = np.zeros(HEADER, np.int32)
        header[:3] = (BLOCKS, int(to_device), len(device))
        self._send(header)
        self._send({"device": np.asarray(device, np.int32), "host": np.asarray(host, np.int32)})

    def reset(self) -> None:
        self._send(_header(RESET))

    def update_weights(self, path: str) -> None:
        """New weights from a checkpoint path (update_weights): every process reads its own
        devices' shards of it into its runner."""
        data = np.frombuffer(path.encode(), np.uint8)
        header = np.zeros(HEADER, np.int32)
        header[:2] = (UPDATE, len(data))
        self._send(header)
        self._send(data)

    def stop(self) -> None:
        """Ends the followers' loops and the group (once; at exit too): every process leaves
        jax.distributed together, so none sees another vanish (which JAX's coordination
        service answers by terminating it)."""
        if self.stopped or self.error is not None:
            return
        self.stopped = True
        try:
            _broadcast(_header(STOP))
        except Exception as error:  # noqa: BLE001 - a follower already gone
            logger.warning("could not stop the followers: %s", error)
            return
        jax.distributed.shutdown()


def follow(runner, reload=None) -> int:
    """A follower's loop: runs every program the leader broadcasts, on this process's shards,
    until the leader stops (then leaves jax.distributed with it); returns the steps run.
    reload(path): reads new weights from a checkpoint into this process's runner (the leader's
    update_weights; LLM.update_weights of the follower's own LLM)."""
    from pagedjax.scheduler.plan import padding_plan

    steps = 0
    while True:
        header = np.asarray(_broadcast(_header(0)))
        command, kind, num_tokens, num_seqs, max_blocks, targets, group_width, k, pooled = (
            int(x) for x in header)
        if command == STOP:
            jax.distributed.shutdown()
            return steps
        if command == RESET:
            runner.reset_kv_cache()
            continue
        if command == UPDATE:  # kind: the path's length in bytes
            path = bytes(np.asarray(_broadcast(np.zeros(kind, np.uint8)))).decode()
            if reload is None:
                raise RuntimeError("the leader updates the weights; this follower was started "
                                   "without a way to read them (follow(runner, reload))")
            reload(path)
            continue
        if command == BLOCKS:  # kind: the direction, num_tokens: the count
            empty = np.zeros(num_tokens, np.int32)
            moved = _broadcast({"device": empty, "host": empty})
            device, host = (np.asarray(moved[k]).tolist() for k in ("device", "host"))
            if kind:
                runner.write_blocks(device, runner.tier_pool, host)
            else:
                runner.blocks_to_host(device, runner.tier_pool, host)
            continue
        if command != STEP:
            raise RuntimeError(f"follower got an unknown command {command} from the leader")
        template = padding_plan(KINDS[kind], num_tokens, num_seqs, max_blocks, targets > 0,
                                runner.num_kv_groups, group_width, k, pooled > 0)
        arrays = _broadcast({name: getattr(template, name) for name in FORWARD_FIELDS})
        fields: dict[str, Any] = {k: np.asarray(v) for k, v in arrays.items()}
        plan = dataclasses.replace(template, **fields)
        jax.block_until_ready(runner.dispatch_forward(plan))  # the leader alone samples
        steps += 1
