"""EngineConfig: every knob of the engine, validated on construction."""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.engine.spec_decode.config import SpeculativeConfig
from pagedjax.lora.request import check_lora_limits
from pagedjax.models.layers.mla_expanded import PREFILL_FORMS
from pagedjax.models.quantization.schemes import SCHEMES
from pagedjax.pallas_kernels import BACKEND_NAMES, check_backend
from pagedjax.scheduler import SchedulerConfig, ShapeBuckets, cdiv

DTYPES = ("float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
STEP_PROGRAMS = ("split", "ragged")
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner
CONVERTS = ("auto", "none", "embed", "classify", "reward")  # vLLM's --convert
# vLLM's logprobs_mode values (pagedjax.engine.sampler.logprob_values)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
QUANTIZATIONS = (None, *SCHEMES, "gguf", "compressed-tensors", "mxfp4")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Give the KV pool as num_blocks, kv_cache_memory_bytes or
    gpu_memory_utilization (one of them); with none, the pool holds max_num_seqs sequences of
    max_model_len tokens."""

    block_size: int = 16
    num_blocks: int | None = None  # physical blocks, including the null block 0
    kv_cache_memory_bytes: int | None = None  # a device's (vLLM's per-GPU meaning): under
    # tensor parallelism each device holds 1/TP of every block, so the pool has TP times the
    # blocks of one device's
    # vLLM's: the fraction of a device's memory the engine may fill (weights, activations and
    # the KV pool, which takes what is left: pagedjax.engine.memory_budget), in (0, 1].
    gpu_memory_utilization: float | None = None
    max_model_len: int = 512
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    policy: str = "mixed"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    victim_policy: str = "lifo"
    preemption_mode: str = "recompute"  # or "swap": preempted KV goes to a host pool
    swap_space_bytes: int = 0  # host pool for swap; 0 with swap falls back to recompute
    # The tiered prefix cache (pagedjax.kv_offload.tiers): blocks the device prefix cache evicts
    # are kept in a host pool of kv_offload_bytes (LRU; --kv-offload-gib), and those it evicts
    # in turn in files under kv_disk_dir up to kv_disk_bytes (--kv-disk-dir, --kv-disk-gib); a
    # prefix lookup walks device, host, disk. 0 / None: no such tier.
    kv_offload_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 0
    watermark: float = 0.01
    dtype: str = "float32"  # activations (and the KV cache unless kv_cache_dtype says otherwise)
    kv_cache_dtype: str = "auto"  # auto (= dtype), int8 or fp8 (e4m3), with per-token,
    # per-head f32 scales
    attention_backend: str = "auto"  # auto | reference | gpu | mosaic_gpu | tpu
    attention_interpret: bool = False  # run the Pallas kernels through the interpreter (CPU)
    # multi-head latent attention's prefill (DeepSeek): auto (by the step's shape), absorbed or
    # expanded (pagedjax.models.layers.mla_expanded)
    mla_prefill: str = "auto"
    max_logprobs: int = 20  # most top logprobs a request may ask for (computed on device)
    # vLLM's: what logprobs report: raw_logprobs (the model's log-softmax before any processing:
    # what a trainer computes), raw_logits, processed_logprobs / processed_logits (after the
    # token mask, logit_bias, penalties, temperature, min-p, top-k and top-p: what is sampled)
    logprobs_mode: str = "raw_logprobs"
    min_token_bucket: int = 16
    min_seq_bucket: int = 1
    # vLLM TPU's bucket padding gap (VLLM_TPU_BUCKET_PADDING_GAP): 0, a step's tokens padded to
    # a power of two; > 0, to powers of two up to it, then to its multiples (less padding, more
    # programs: scheduler.buckets.token_paddings)
    token_padding_gap: int = 0
    # Prefill B: "per_token_bucket" (one program per token bucket, B padded to what T tokens
    # can hold) or "bucketed" (a program per (T, B)); see scheduler.ShapeBuckets and
    # benchmarks/prefill_buckets.py (default config: 12 programs instead of 41, warmup 15x
    # shorter, prefill steps 4-18% slower on the CPU reference).
    prefill_seqs: str = "per_token_bucket"
    # Step program families: "split" (decode programs, T == B, with the decode kernels, beside
    # the ragged programs) or "ragged" (every step on the ragged programs, as vLLM V1 and
    # tpu-inference: 6 programs instead of 12 at the defaults). benchmarks/
    # mixed_vs_transformers.py on the CPU: ragged's first call (compiles counted) 13.1 s vs
    # 15.0 s, but its warm decode 20% slower; with the persistent compilation cache every
    # session after the first pays no compile, so split is the default.
    step_programs: str = "split"
    seed: int = 0
    # JAX's persistent compilation cache: "auto" (~/.cache/pagedjax/jax_cache, or
    # $PAGEDJAX_COMPILATION_CACHE), "off", or a directory (pagedjax.engine.compile_cache).
    compilation_cache: str = "auto"
    # The decoder layers under one jax.lax.scan (pagedjax.models.paged_forward): a step program
    # compiles one layer whatever the depth. False unrolls them (L copies of the layer in every
    # program: longer compiles). None: scanned, except on the CPU for layers of 8 MiB or more,
    # whose weights XLA's CPU backend would copy out of the stack every step
    # (paged_forward.scan_by_default).
    scan_layers: bool | None = None
    # KV cache groups (scheduler.kv_cache_groups): a model whose layers differ in attention
    # window (Gemma 2/3) keeps a block table per group and its sliding layers only their
    # window's blocks. True (vLLM's --disable-hybrid-kv-cache-manager) gives every layer the
    # whole context.
    disable_hybrid_kv_cache_manager: bool = False
    # Tensor parallelism over this many local devices (pagedjax.parallel.sharding): weights Megatron-
    # style, the KV cache over KV heads; 1 runs on jax.devices()[0].
    tensor_parallel_size: int = 1
    # Expert parallelism (vLLM's --enable-expert-parallel): a mixture of experts' experts split
    # over the tensor_parallel_size devices (E / TP whole experts each, models/layers/moe_experts.py)
    # instead of every expert's MLP split TP ways; attention stays tensor parallel.
    enable_expert_parallel: bool = False
    # Replicas of the model on disjoint groups of tensor_parallel_size devices, each with its
    # own KV pool and scheduler, behind one engine (pagedjax.frontend.data_parallel): requests placed by
    # the router's prefix-affinity rule. The pool size (num_blocks, kv_cache_memory_bytes) is
    # each replica's.
    data_parallel_size: int = 1
    # Speculative decoding (pagedjax.engine.spec_decode.speculator): vLLM's speculative_config, as a
    # SpeculativeConfig, a dict of its fields or their JSON; None: none.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # vLLM's --async-scheduling (pagedjax.engine.async_scheduling): the host schedules and
    # dispatches step N + 1 while the device runs step N, whose sampled tokens step N + 1 reads
    # on the device; outputs identical to synchronous stepping. A step whose requests need their
    # last token on the host to go on (penalties, a grammar, bad_words of several tokens, forks
    # of n > 1) is followed synchronously. Not with speculative decoding or swap preemption.
    async_scheduling: bool = False
    # Weight quantization (vLLM's --quantization; models/quantization/schemes.py), weight-only (the
    # activations stay in dtype): "int8" and "fp8" (e4m3) per output channel, "int4" per group
    # of 128/64/32 rows, quantized as a float checkpoint is read; "gguf": a GGUF file's own
    # blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), what a GGUF file is served as when unset;
    # "compressed-tensors": an llm-compressor fp8 / int8 checkpoint's own (models/
    # compressed_tensors.py), also what it gets unset; "mxfp4": a gpt-oss checkpoint's MXFP4
    # experts (models/quantization/mxfp4.py), also unset. None: as the checkpoint stores them.
    quantization: str | None = None
    # The LM head quantized too (the tied embedding table of a model without lm_head).
    quantize_lm_head: bool = False
    # Multi-LoRA (vLLM's): requests name adapters (LoRARequest) over the one base model;
    # max_loras device slots (a step's adapters all resident), each adapter padded to
    # max_lora_rank, max_cpu_loras adapters kept read on the host (None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # vLLM's --runner (generate, pooling: embeddings, classification, scores; auto: pooling for
    # a *ForSequenceClassification checkpoint), --pooler-config (pooling_type, normalize) and
    # hf_overrides (classifier_from_token, is_original_qwen3_reranker), --convert (embed,
    # classify, reward: what a pooling runner serves the model as): read by LLM
    # (pagedjax.frontend.pooling_setup).
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: dict | None = None
    hf_overrides: dict | None = None

    def __post_init__(self):
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.create(self.speculative_config))
        self._check_types()
        self._check_pool_size()
        self._check_choices()
        self._check_async_scheduling()
        self._check_kv_tiers()
        self._check_lora()
        self.buckets()  # ShapeBuckets validates prefill_seqs and token_padding_gap
        self.scheduler_config()  # SchedulerConfig validates the scheduler's fields (policy, ...)

    def _check_types(self) -> None:
        """The integer, optional-integer and boolean fields."""
        for name in ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "min_token_bucket", "min_seq_bucket", "tensor_parallel_size",
                     "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_logprobs", "swap_space_bytes",
                     "seed", "kv_offload_bytes", "kv_disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (value is None or isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
        if self.scan_layers is not None and not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers must be a boolean or None, got "
                             f"{type(self.scan_layers).__name__}")
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "attention_interpret",
                     "disable_hybrid_kv_cache_manager",
                     "enable_expert_parallel", "quantize_lm_head", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got "
                                 f"{type(getattr(self, name)).__name__}")
        if self.max_logprobs is None or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")

    def _check_pool_size(self) -> None:
        """The KV pool's size (one of num_blocks, kv_cache_memory_bytes,
        gpu_memory_utilization) and the swap space."""
        sizes = [name for name in ("num_blocks", "kv_cache_memory_bytes",
                                   "gpu_memory_utilization") if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise ValueError(f"give one of num_blocks, kv_cache_memory_bytes and "
                             f"gpu_memory_utilization, not {' and '.join(sizes)}")
        utilization = self.gpu_memory_utilization
        if utilization is not None and (isinstance(utilization, bool) or not isinstance(
                utilization, (int, float)) or not 0.0 < utilization <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], "
                             f"got {utilization!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int)
                                            or self.num_blocks < 2):
            raise ValueError(f"num_blocks must be an integer >= 2 (block 0 is the null block), "
                             f"got {self.num_blocks!r}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, "
                             f"got {self.kv_cache_memory_bytes!r}")
        if not isinstance(self.swap_space_bytes, int) or self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be an integer >= 0, "
                             f"got {self.swap_space_bytes!r}")

    def _check_choices(self) -> None:
        """The fields that name one of a set: dtypes, the attention backend, quantization, step
        programs, the compilation cache; and max_num_seqs against the token budget."""
        if not isinstance(self.compilation_cache, str) or not self.compilation_cache:
            raise ValueError(f"compilation_cache must be 'auto', 'off' or a directory, "
                             f"got {self.compilation_cache!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, "
                             f"got {self.attention_backend!r}")
        if self.attention_backend != "auto":  # 'auto' is checked once resolved (placement)
            check_backend(self.attention_backend, block_size=self.block_size, dtype=self.dtype,
                          kv_cache_dtype=self.kv_cache_dtype)
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be <= "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.quantize_lm_head and self.quantization not in SCHEMES:
            raise ValueError(f"quantize_lm_head needs quantization in {SCHEMES}, "
                             f"got {self.quantization!r}")
        if self.mla_prefill not in PREFILL_FORMS:
            raise ValueError(f"mla_prefill must be one of {PREFILL_FORMS}, "
                             f"got {self.mla_prefill!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ValueError(f"convert must be one of {CONVERTS}, got {self.convert!r}")
        for name in ("pooler_config", "hf_overrides"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict (JSON object), got "
                                 f"{getattr(self, name)!r}")
        if self.step_programs not in STEP_PROGRAMS:
            raise ValueError(f"step_programs must be one of {STEP_PROGRAMS}, "
                             f"got {self.step_programs!r}")

    def _check_async_scheduling(self) -> None:
        if not self.async_scheduling:
            return
        for name, value, plain in (("speculative_config", self.speculative_config, None),
                                   ("preemption_mode", self.preemption_mode, "recompute")):
            if value != plain:
                raise ValueError(f"async_scheduling is not supported with {name}={value!r} "
                                 f"(needs {plain!r}); turn one of them off")

    def _check_kv_tiers(self) -> None:
        for name in ("kv_offload_bytes", "kv_disk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.kv_disk_dir is not None and not isinstance(self.kv_disk_dir, str):
            raise ValueError(f"kv_disk_dir must be a directory path, got {self.kv_disk_dir!r}")
        if (self.kv_disk_dir is None) != (self.kv_disk_bytes == 0):
            raise ValueError("kv_disk_dir and kv_disk_bytes go together (a directory and its "
                             f"size), got kv_disk_dir={self.kv_disk_dir!r}, "
                             f"kv_disk_bytes={self.kv_disk_bytes!r}")
        tiers = self.kv_offload_bytes or self.kv_disk_dir is not None
        if self.kv_disk_dir is not None and not self.kv_offload_bytes:
            raise ValueError("kv_disk_dir needs kv_offload_bytes > 0: the disk tier keeps what "
                             "the host tier evicts")
        if tiers and not self.enable_prefix_caching:
            raise ValueError("kv_offload_bytes needs enable_prefix_caching: the tiers keep the "
                             "prefix cache's evicted blocks")

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be a boolean, got {self.enable_lora!r}")
        check_lora_limits(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine config field(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    @property
    def np_dtype(self):
        import ml_dtypes  # shipped with jax
        return np.dtype(ml_dtypes.bfloat16) if self.dtype == "bfloat16" else np.dtype(self.dtype)

    @property
    def kv_np_dtype(self):
        """The KV cache's element type."""
        import ml_dtypes
        return {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}.get(
            self.kv_cache_dtype, self.np_dtype)

    @property
    def max_blocks_per_seq(self) -> int:
        return cdiv(self.max_model_len, self.block_size)

    def resolve_num_blocks(self, bytes_per_block: int, blocks_per_seq: int | None = None) -> int:
        """Physical blocks in the pool (including the null block); with gpu_memory_utilization
        a provisional 2 (the engine measures the device's memory once the weights are placed).
        blocks_per_seq: what a max_model_len sequence holds (over a hybrid model's KV cache
        groups; default max_blocks_per_seq)."""
        if self.gpu_memory_utilization is not None:
            return 2
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_memory_bytes is not None:
            num_blocks = self.kv_cache_memory_bytes // bytes_per_block
            if num_blocks < 2:
                raise ValueError(f"kv_cache_memory_bytes ({self.kv_cache_memory_bytes}) holds "
                                 f"{num_blocks} blocks of {bytes_per_block} bytes; at least 2 "
                                 f"are needed")
            return num_blocks
        return 1 + self.max_num_seqs * (blocks_per_seq or self.max_blocks_per_seq)

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, policy=self.policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_prefix_caching=self.enable_prefix_caching,
            victim_policy=self.victim_policy, watermark=self.watermark,
            preemption_mode=self.preemption_mode)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config as construction made it (the field also takes vLLM's dict or
        its JSON text)."""
        return SpeculativeConfig.create(self.speculative_config)

    def buckets(self, group_windows: tuple[int | None, ...] = (None,)) -> ShapeBuckets:
        """The step shapes; group_windows: the model's KV cache groups' windows (the width of
        a sliding group's block table)."""
        spec = self.speculative
        return ShapeBuckets.create(
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, block_size=self.block_size,
            min_token_bucket=self.min_token_bucket, min_seq_bucket=self.min_seq_bucket,
            prefill_seqs=self.prefill_seqs, token_padding_gap=self.token_padding_gap,
            decode_programs=self.step_programs == "split", group_windows=group_windows,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            max_speculative_seqs=None if spec is None else spec.disable_by_batch_size)
