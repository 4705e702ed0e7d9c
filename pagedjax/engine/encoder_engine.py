"""EncoderEngine: pooling requests on a bidirectional encoder (BERT-like: models.families.bert).

Why not the paged engine: in an encoder every token attends to every other token of its
sequence, so no state of a sequence exists before all of it is in (no chunked prefill), no
prefix is shared (a prefix's states depend on what follows it), and nothing is decoded (no
KV cache to keep). Its prompts are short (512 positions). So each step takes up to
max_num_seqs waiting requests, pads them to a [B, L] batch (B and L powers of two: a bounded
number of compiled programs) and runs the dense encoder on it, one jit program per shape;
each request's rows are pooled (pagedjax.pooling) and it finishes in that step.

It answers what LLM's pooling methods and the server's front-end (pagedjax.frontend.
engine_driver) ask of an engine: pooling_spec, add_requests with admission control's check,
step, abort, fail_all, request_groups (each request a scheduler Request, for the driver's
books), load and blocks_for (no KV pool: zero blocks), stats, held memory.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.engine.compile_cache import enable_compilation_cache
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.outputs import PoolingRequestOutput
from pagedjax.engine.pooling_requests import (PROMPT_ONLY, add_pooling_request,
                                              check_pooling_params, check_token_type_ids,
                                              pooling_spec)
from pagedjax.engine.request_checks import Admission, PromptSpec, check_prompt_token_ids
from pagedjax.engine.stats import EngineStats, ReplicaLoad
from pagedjax.engine.warmup import BackgroundWarmup
from pagedjax.pooling.pooling_model import PoolingModel
from pagedjax.scheduler import Request, RequestStatus
from pagedjax.scheduler.errors import RequestError

MIN_LENGTH = 16  # the shortest padded length


@dataclasses.dataclass
class _Queued:
    request: Request  # the driver's view: its prompt, status and times
    spec: PromptSpec

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def ids(self) -> list[int]:
        return self.request.prompt_token_ids


@dataclasses.dataclass
class EncoderRunner:
    """What the engine holds on its device: the encoder's parameters and no KV cache."""

    params: object
    kv_cache: tuple = ()


def bucket(n: int, least: int, most: int) -> int:
    """The power of two >= n (at least `least`), capped at most."""
    return min(most, max(least, 1 << max(0, n - 1).bit_length()))


class EncoderEngine:
    pooling_spec = pooling_spec  # where pooling requests enter (pagedjax.engine.pooling_requests)
    check_pooling_params = check_pooling_params
    add_pooling_request = add_pooling_request
    runner_type = "pooling"
    hybrid_kv_cache = False
    num_blocks = 1  # the paged engine's null block: no pool
    weight_version = "0"
    memory_budget = None  # no KV pool to size

    def __init__(self, model, config: EngineConfig, pooling_model: PoolingModel, *,
                 tokenizer=None, clock: Callable[[], float] = time.perf_counter):
        self.config = dataclasses.replace(
            config, max_model_len=min(config.max_model_len, model.config.max_tokens))
        self.model_config = model.config
        self.pooling_model = pooling_model
        self.tokenizer = tokenizer
        self.clock = clock
        graph, state = nnx.split(model)
        self.devices = [jax.devices()[0]]
        self.runner = EncoderRunner(jax.device_put(state, self.devices[0]))
        reads_types = getattr(model.config, "reads_token_types", False)
        self._forward = jax.jit(lambda s, ids, mask, types: nnx.merge(graph, s)(
            ids, mask, *((types,) if reads_types else ())))
        self._programs: dict[tuple[int, int], jax.stages.Compiled] = {}  # (B, L) -> program
        self._lock = threading.Lock()
        self.compilation_cache_dir = enable_compilation_cache(config.compilation_cache)
        self._waiting: collections.deque[_Queued] = collections.deque()
        self._running: list[_Queued] = []  # the batch of the step under way
        self.request_groups: dict[str, list[Request]] = {}  # request id -> [its Request]
        self.stats = EngineStats(block_size=self.config.block_size)
        self._next_id = 0

    @property
    def held_memory(self) -> tuple[int, int]:
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self.runner.params)), 0

    @property
    def has_work(self) -> bool:
        return bool(self._waiting)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks a sequence holds: none (admission's KV rule has nothing to count)."""
        return 0

    def load(self) -> list[ReplicaLoad]:
        return [ReplicaLoad(len(self._running), len(self._waiting), 0, 0, 0)]

    @property
    def replicas(self) -> list["EncoderEngine"]:
        return [self]

    def scheduler_states(self) -> list:
        """None: an encoder runs its queue whole, without a paged scheduler (the engine driver
        counts its requests' tokens as not yet started until they finish)."""
        return []

    def add_requests(self, specs: Sequence[PromptSpec], admit=None) -> list[str]:
        """Queues pooling requests all or none (admit, when given, sees their Admissions
        first and may refuse them all); RequestError naming the field otherwise."""
        admissions, request_ids = [], []
        taken = set(self.request_groups)
        for i, spec in enumerate(specs):
            if spec.pooling_params is None:
                raise RequestError(None, "an encoder serves pooling requests only")
            self.check_pooling_params(spec.pooling_params)
            ids = check_prompt_token_ids(spec.prompt_token_ids, self.model_config.vocab_size,
                                         self.config.max_model_len)
            if spec.token_type_ids is not None:
                check_token_type_ids(self, ids, spec.token_type_ids)
            request_id = spec.request_id or f"enc-{self._next_id + i}"
            if request_id in taken:
                raise RequestError("request_id", f"request_id {request_id!r} is already in use")
            taken.add(request_id)
            request_ids.append(request_id)
            admissions.append(Admission(spec, ids, request_id))
        if admit is not None:
            admit(admissions)
        self._next_id += len(specs)
        now = self.clock()
        for a, request_id in zip(admissions, request_ids):
            request = Request(request_id, a.prompt_token_ids, PROMPT_ONLY, seed=0,
                              arrival_time=a.spec.arrival_time or now)
            self.request_groups[request_id] = [request]
            self._waiting.append(_Queued(request, a.spec))
        return request_ids

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def abort(self, request_id: str) -> None:
        """Drops a waiting request; unknown or finished ids are ignored."""
        samples = self.request_groups.pop(request_id, None)
        if samples is None:
            return
        samples[0].status = RequestStatus.FINISHED_ABORTED
        self._waiting = collections.deque(q for q in self._waiting
                                          if q.request_id != request_id)
        self.stats.num_aborted += 1

    def fail_all(self, error: BaseException) -> list[PoolingRequestOutput]:
        """The step under way failed: its requests fail alone, the engine serves on."""
        failed, self._running = self._running, []
        now = self.clock()
        self.stats.num_failed += len(failed)
        return [self._finish(q, np.zeros(0, np.float32), now, now,
                             f"{type(error).__name__}: {error}") for q in failed]

    def step(self, final_only: bool = False) -> list[PoolingRequestOutput]:
        """Encodes up to max_num_seqs waiting requests as one padded batch; their outputs."""
        if not self._waiting:
            return []
        self._running = [self._waiting.popleft()
                         for _ in range(min(len(self._waiting), self.config.max_num_seqs))]
        start = self.clock()
        lengths = [len(q.ids) for q in self._running]
        length = bucket(max(lengths), MIN_LENGTH, self.config.max_model_len)
        rows = bucket(len(lengths), 1, self.config.max_num_seqs)
        ids, types = np.zeros((2, rows, length), np.int32)
        mask = np.zeros((rows, length), bool)
        for row, queued in enumerate(self._running):
            ids[row, :lengths[row]] = queued.ids
            mask[row, :lengths[row]] = True
            if queued.spec.token_type_ids is not None:
                types[row, :lengths[row]] = queued.spec.token_type_ids
        states = np.asarray(self.runner_forward(ids, mask, types), np.float32)
        done = self.clock()
        batch, self._running = self._running, []
        self._count(lengths, done - start)
        return [self._finish(q, self._pooled(q, states[row, :lengths[row]]), start, done)
                for row, q in enumerate(batch)]

    def runner_forward(self, ids: np.ndarray, mask: np.ndarray, types: np.ndarray) -> jax.Array:
        return self._program(*ids.shape)(self.runner.params, ids, mask, types)

    def shapes(self) -> list[tuple[int, int]]:
        """Every (B, L) a step can take: the buckets of 1 .. max_num_seqs rows and of
        1 .. max_model_len tokens."""
        config = self.config
        rows = sorted({bucket(n, 1, config.max_num_seqs) for n in range(1, config.max_num_seqs
                                                                         + 1)})
        lengths = sorted({bucket(n, MIN_LENGTH, config.max_model_len)
                          for n in range(1, config.max_model_len + 1)})
        return [(b, length) for b in rows for length in lengths]

    def _program(self, rows: int, length: int) -> jax.stages.Compiled:
        """The forward program of a shape, compiled once (from the persistent cache when an
        earlier process compiled it); thread-safe (a warmup thread and the engine's)."""
        with self._lock:
            if (rows, length) not in self._programs:
                shape = (rows, length)
                ids = jax.ShapeDtypeStruct(shape, jnp.int32)
                self._programs[shape] = self._forward.lower(
                    self.runner.params, ids, jax.ShapeDtypeStruct(shape, jnp.bool_),
                    ids).compile()
            return self._programs[rows, length]

    def warmup(self, progress: bool = False, variants: bool = True) -> int:
        """Compiles every shape's program (shapes()); returns how many. (progress, variants:
        the paged engine's arguments; an encoder has one program a shape.)"""
        for shape in self.shapes():
            self._program(*shape)
        return len(self.shapes())

    def start_warmup(self, progress: bool = False, variants: bool = True) -> "EncoderWarmup":
        return EncoderWarmup(self)

    @property
    def num_compiled_programs(self) -> int:
        return len(self._programs)

    def close(self) -> None:
        """Nothing to hand back: no tier, no followers."""

    def _count(self, lengths: list[int], seconds: float) -> None:
        stats = self.stats
        stats.num_steps += 1
        stats.num_prefill_steps += 1
        stats.num_scheduled_tokens += sum(lengths)
        stats.num_prompt_tokens_computed += sum(lengths)
        stats.num_finished += len(lengths)
        stats.max_running = max(stats.max_running, len(lengths))
        stats.step_time_s += seconds

    def _pooled(self, queued: _Queued, states: np.ndarray) -> np.ndarray:
        params = queued.spec.pooling_params
        if params is None:  # add_requests refuses it
            raise RuntimeError(f"{queued.request_id!r} has no pooling_params")
        pool = self.pooling_model.sequence(params)
        pool.add(states, 0)
        return self.pooling_model.finish(pool.result(), params,
                                         queued.request.prompt_token_ids)

    def _finish(self, queued: _Queued, data: np.ndarray, start: float, done: float,
                error: str | None = None) -> PoolingRequestOutput:
        request = queued.request
        request.status = (RequestStatus.FINISHED_ERROR if error is not None
                          else RequestStatus.FINISHED_STOPPED)
        request.num_computed_tokens = request.num_prompt_tokens
        request.first_scheduled_time, request.first_token_time = start, done
        request.finish_time = done
        self.request_groups.pop(request.request_id, None)
        return PoolingRequestOutput.from_sample(request, data, queued.spec.prompt_text, error)


class EncoderWarmup(BackgroundWarmup):
    """EncoderEngine.warmup() on a thread (BackgroundWarmup's done(), wait(), error,
    seconds, num_programs)."""

    def __init__(self, engine: EncoderEngine):  # super().__init__ warms a paged runner
        self.num_programs = len(engine.shapes())
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._warm, args=(engine,),
                                        name="pagedjax-encoder-warmup", daemon=True)
        self._thread.start()

    def _warm(self, engine: EncoderEngine) -> None:
        start = time.perf_counter()
        try:
            engine.warmup()
        except BaseException as error:  # noqa: BLE001 - reported through .error
            self.error = error
        self.seconds = time.perf_counter() - start
