"""Where one engine runs: its devices (this process's, or every process's for a multi-host
model), whether that spans processes, and its attention backend over them."""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import jax

from pagedjax.pallas_kernels import AttentionBackend, check_backend, resolve_backend
from pagedjax.pallas_kernels.dispatch import LATENT_BACKENDS, SINK_BACKENDS
from pagedjax.pallas_kernels.gpu.triton.latent import latent_dims_problem
from pagedjax.parallel import multihost
from pagedjax.parallel.sharding import check_tensor_parallel, make_mesh

logger = logging.getLogger("pagedjax.engine")


def check_expert_parallel(model_config, config) -> None:
    """enable_expert_parallel needs a mixture of experts whose experts split evenly."""
    if not config.enable_expert_parallel:
        return
    experts, tp = model_config.num_experts, config.tensor_parallel_size
    if not experts:
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model; this one "
                         "has no experts")
    if experts % tp:
        raise ValueError(f"enable_expert_parallel: the model's {experts} experts do not split "
                         f"over tensor_parallel_size {tp} devices (it must divide them)")


def place(model_config, config, devices: Sequence | None = None
          ) -> tuple[list, bool, AttentionBackend]:
    """(the first tensor_parallel_size devices, multi-host or not, the attention backend: on a
    mesh of them past one device). devices default to this process's own, unless the model
    needs more than it has (multi-host: every process's)."""
    tp = config.tensor_parallel_size
    check_tensor_parallel(model_config, tp)
    if devices is None:
        devices = jax.local_devices() if tp <= jax.local_device_count() else jax.devices()
    devices = list(devices)
    if len(devices) < tp:
        raise ValueError(f"tensor_parallel_size ({tp}) exceeds the {len(devices)} devices given")
    devices = devices[:tp]
    # Over several processes' devices: every process runs each step (pagedjax.parallel.multihost).
    spans_processes = len({d.process_index for d in devices}) > 1
    if spans_processes:
        multihost.check_multihost(config, devices)
    check_expert_parallel(model_config, config)
    backend = resolve_backend(config.attention_backend, config.attention_interpret)
    backend = dataclasses.replace(model_backend(model_config, config, backend),
                                  latent_prefill=config.mla_prefill)
    if tp > 1:
        backend = dataclasses.replace(backend, mesh=make_mesh(tp, devices),
                                      expert_parallel=config.enable_expert_parallel)
    check_backend(backend.name, block_size=config.block_size, dtype=config.dtype,
                  kv_cache_dtype=config.kv_cache_dtype)
    return devices, spans_processes, backend


def model_backend(model_config, config, backend: AttentionBackend) -> AttentionBackend:
    """backend, or the reference for a latent-attention model under 'auto' where the
    platform's kernels have no latent cache (said in the log); ValueError naming what the model
    needs that the backend (or the config) does not serve."""
    latent = bool(model_config.kv_lora_rank)
    problem = latent and backend.name == "gpu" and latent_dims_problem(
        model_config.kv_lora_rank, model_config.qk_rope_head_dim)
    if latent and config.attention_backend == "auto" and (
            problem or backend.name not in LATENT_BACKENDS):
        logger.info("attention_backend auto: the jnp reference serves multi-head latent "
                    "attention on %s (%s)", backend.name,
                    problem or "its Pallas kernels do not take a latent cache")
        backend, problem = resolve_backend("reference"), None
    if problem:
        raise ValueError(f"attention_backend 'gpu': the Triton latent kernels need the model's "
                         f"latent and RoPE dims powers of two: {problem}")
    if model_config.attention_sinks and backend.name not in SINK_BACKENDS:
        raise ValueError(f"attention_backend {backend.name!r}: the model's attention sinks "
                         f"(gpt-oss) are built in the {SINK_BACKENDS} kernels only")
    if latent and backend.name not in LATENT_BACKENDS:
        raise ValueError(f"attention_backend {backend.name!r}: the model's multi-head latent "
                         f"attention (DeepSeek) is built in the {LATENT_BACKENDS} backends "
                         f"only")
    if latent and config.enable_lora:
        raise ValueError("enable_lora: LoRA adapters on multi-head latent attention "
                         "(DeepSeek) are not supported")
    return backend
