"""GGUF files (llama.cpp's format) -> LlamaConfig, weights and a tokenizer.

Read with the `gguf` package, llama.cpp's own Python reader, which also dequantizes: tensors in
F32, F16, BF16, Q8_0, Q4_0, Q4_1 (and the other block formats it dequantizes: Q5_0, Q5_1, the
K-quants) become the engine's dtype, one tensor at a time; any other type is refused by name.
llama.cpp's converter permutes the rows of the q and k projections (its RoPE pairs adjacent
elements, HF's the two halves of a head): undone here, so the weights are HF's, and the model
runs them as any HF checkpoint. The config comes from the `llama.*` metadata; only the Llama
architecture is accepted (Mistral-style and Llama 3 checkpoints are written as `llama`, and so
is Mixtral: `llama.expert_count`, the router `ffn_gate_inp` and each projection of all the
experts stacked, `ffn_{gate,up,down}_exps`, read expert by expert as HF's names).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import LlamaForCausalLM
from pagedjax.models.loading.user_files import checked_path

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                   "Q3_K", "Q4_K", "Q5_K", "Q6_K")
LAYER_NAMES = {  # GGUF blk.{i}.<name> -> HF model.layers.{i}.<name>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
# A mixture of experts (llama.cpp writes Mixtral as `llama` with llama.expert_count): the
# router, and each projection of all the experts stacked in one tensor [E, out, in], read as
# the HF names of its experts (pagedjax.models.loading.hf.EXPERT for the index).
MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
             "ffn_up_exps": "mlp.experts.{expert}.up_proj",
             "ffn_down_exps": "mlp.experts.{expert}.down_proj"}


_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def is_gguf(path) -> bool:
    return os.path.isfile(path) and os.fspath(path).endswith(".gguf")


def open_gguf(path: str):
    """The file's gguf.GGUFReader (a bad file raises ValueError naming it)."""
    return _reader(path)


def _reader(path: str):
    import gguf

    checked_path(path, "GGUF file")  # a regular file (the reader maps it), never a FIFO
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises several types for a bad file
        raise ValueError(f"{path}: not a readable GGUF file: {e}") from e


def metadata(reader) -> dict:
    """Every key-value field: scalars, strings, and lists."""
    values = {}
    for key, field in reader.fields.items():
        try:
            values[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field the reader cannot decode: left out
            continue
    return values


def config_from_gguf(meta: dict, tensor_names: set[str], path: str = "") -> LlamaConfig:
    from pagedjax.models.registry import ARCHITECTURES, GGUF_ARCHITECTURES
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported: GGUF files are "
                         f"read for {', '.join(sorted(GGUF_ARCHITECTURES))} "
                         f"(models/registry.py); for Gemma, Qwen and others use their Hugging "
                         f"Face checkpoints ({', '.join(ARCHITECTURES)})")

    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata llama.{key} is missing")
        return value

    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling {scaling!r} in a GGUF is not supported")
    heads, hidden = int(get("attention.head_count")), int(get("embedding_length"))
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    experts = int(meta.get("llama.expert_count") or 0)
    moe: dict[str, Any] = {}
    if experts:  # llama.cpp's Mixtral: softmax top-k, the k weights renormalised
        moe = dict(num_experts=experts, num_experts_per_tok=int(get("expert_used_count")),
                   norm_topk_prob=True)
    return LlamaConfig(
        **moe, vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
        num_heads=heads, num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(meta.get("llama.attention.key_length", hidden // heads)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(get("context_length", 2048)),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos), model_type="llama")


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a GGUF tensor name (a stacked experts' tensor: with
    pagedjax.models.loading.hf.EXPERT for the expert)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        module = LAYER_NAMES.get(parts[2]) or MOE_NAMES[parts[2]]
        return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    return f"{TOP_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation undone: its rows (a head's pairs interleaved) back to
    HF's (a head's two halves)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def checked_gguf(path: str, dtype: str = "float32", reader=None, blocks: bool = False):
    """(abstract model in dtype, opened, metadata) where opened() yields tensor(HF name) -> the
    tensor dequantized to f32 in HF's layout; every tensor's name, type and shape checked
    first. reader: the file's gguf.GGUFReader when already open (parsing one takes seconds).
    blocks: the weights in a served block format (pagedjax.models.quantization.gguf_blocks) stay quantized: the
    abstract model has their quantized modules, and tensor.quantized_parts(name) reads them."""
    reader = _reader(path) if reader is None else reader
    meta = metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    config = config_from_gguf(meta, set(tensors), path)
    jdtype = jnp.dtype(dtype)
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0), dtype=jdtype,
                                                       param_dtype=jdtype))
    from pagedjax.models.loading.names import EXPERT, hf_weight_name

    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    wanted = {hf_weight_name(p)[0]: (x.shape, hf_weight_name(p)[1])
              for p, x in jax.tree_util.tree_leaves_with_path(params)}
    by_hf = {}
    for name, tensor in tensors.items():
        try:
            hf = hf_name(name)
        except (KeyError, IndexError):
            raise ValueError(f"{path}: tensor {name!r} is not part of a Llama model") from None
        if tensor.tensor_type.name not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {name} is {tensor.tensor_type.name}, which is not "
                             f"supported (supported: {', '.join(SUPPORTED_TYPES)})")
        by_hf[hf] = tensor
    missing = sorted(set(wanted) - set(by_hf))
    if missing:
        raise ValueError(f"{path}: tensors missing: {missing[:5]}")
    for hf, (shape, transpose) in wanted.items():
        stored = tuple(int(d) for d in reversed(by_hf[hf].shape))  # GGUF lists ne[0] first
        expected = tuple(shape[::-1] if transpose else shape)
        if EXPERT in hf:  # [E, in, out] stored as E tensors [out, in]
            expected = (shape[0], *shape[:0:-1])
        if stored != expected:
            raise ValueError(f"{path}: tensor {by_hf[hf].name} has shape {stored}, the "
                             f"metadata implies {expected}")
    formats = _block_formats(by_hf) if blocks else {}
    if formats:
        from pagedjax.models.layers.quantized import Spec, with_quantized_modules

        def spec(key):
            chosen = formats.get(key)
            return None if chosen is None else Spec(chosen.scheme, chosen.group, chosen.zero)

        abstract = with_quantized_modules(abstract, spec)
    return abstract, _hf_tensors(by_hf, config, formats), meta


def _module_key(hf: str) -> tuple:
    """The pagedjax.models.layers.quantized.module_key of an HF weight's module."""
    parts = hf.split(".")[:-1]
    if parts[:2] == ["model", "layers"]:
        return ("layers", "{layer}", *parts[3:])
    return tuple(parts[1:] if parts[0] == "model" else parts)


def _block_formats(by_hf: dict) -> dict:
    """module_key -> the pagedjax.models.quantization.gguf_blocks format its weights are served in, for the modules
    whose every layer's tensor is in a served block type (the experts' stacked tensors and
    the router stay dequantized)."""
    from pagedjax.models.layers.quantized import QUANTIZED_LINEARS
    from pagedjax.models.loading.names import EXPERT
    from pagedjax.models.quantization.gguf_blocks import common_format

    types: dict[tuple, set] = {}
    for hf, tensor in by_hf.items():
        key = _module_key(hf)
        if EXPERT in hf or key[-1] not in (*QUANTIZED_LINEARS, "lm_head", "embed_tokens"):
            continue
        types.setdefault(key, set()).add(tensor.tensor_type.name)
    formats = {key: common_format(names) for key, names in types.items()}
    return {key: chosen for key, chosen in formats.items() if chosen is not None}


def _hf_tensors(by_hf: dict, config: LlamaConfig, formats: dict):
    """opened(): a context yielding tensor(HF name) -> f32 in HF's layout, the q/k permutation
    undone; one expert's tensor is its slice of the stacked one (by_hf: HF name -> GGUF
    tensor, stacked experts' names with pagedjax.models.loading.hf.EXPERT). tensor.quantized_parts((HF name,
    transposed)): a weight of a module in formats (module key -> pagedjax.models.quantization.gguf_blocks format)
    as pagedjax.models.quantization.schemes's stored form, from its blocks."""
    from pagedjax.models.loading.names import EXPERT
    from pagedjax.models.quantization.gguf_blocks import FORMATS, decode, stored_parts

    permuted = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}

    def heads_of(name: str) -> int | None:
        return next((heads for module, heads in permuted.items()
                     if f".{module}.weight" in name), None)

    def quantized_parts(name_and_transpose: tuple[str, bool]) -> dict:
        name = name_and_transpose[0]
        stored, target = by_hf[name], formats[_module_key(name)]
        type_name = stored.tensor_type.name
        shape = tuple(int(d) for d in reversed(stored.shape))
        q, scale, zero = decode(stored.data, type_name, shape)
        heads = heads_of(name)
        if heads is not None:  # rows of [out, in]: values, scales and offsets alike
            q, scale = _unpermute(q, heads), _unpermute(scale, heads)
            zero = None if zero is None else _unpermute(zero, heads)
        return stored_parts(q, scale, zero, target, FORMATS[type_name].group)

    @functools.lru_cache(maxsize=1)  # a tensor is asked for shard by shard, layer by layer,
    def dequantized(name: str) -> np.ndarray:  # expert by expert
        import gguf

        stored = by_hf[name]
        shape = tuple(int(d) for d in reversed(stored.shape))
        weight = gguf.quants.dequantize(stored.data, stored.tensor_type).astype(np.float32)
        weight = weight.reshape(shape)
        heads = heads_of(name)
        return weight if heads is None else _unpermute(weight, heads)

    def tensor(name: str) -> np.ndarray:
        """An HF-named tensor; one expert's is its slice of the stacked tensor."""
        expert = _EXPERT_INDEX.search(name)
        if name in by_hf or expert is None:
            return dequantized(name)
        stacked = name[:expert.start(1)] + EXPERT + name[expert.end(1):]
        return dequantized(stacked)[int(expert.group(1))]

    if formats:
        tensor.quantized_parts = quantized_parts  # type: ignore[attr-defined]  # (see above)

    @contextlib.contextmanager
    def opened():
        try:
            yield tensor
        finally:
            dequantized.cache_clear()

    return opened


def lazy_gguf_model(path: str, dtype: str = "float32", reader=None, blocks: bool = True):
    """A pagedjax.models.loading.placed_weights.LazyModel of a GGUF file: checked, nothing read yet; the weights
    in a served block format (pagedjax.models.quantization.gguf_blocks) stay in their blocks (blocks=False: every
    weight dequantized to dtype as it is read)."""
    from pagedjax.models.loading.placed_weights import lazy_from_tensors

    abstract, opened, _ = checked_gguf(path, dtype, reader, blocks=blocks)
    return lazy_from_tensors(abstract, opened, np.dtype(jnp.dtype(dtype)), path)


def load_gguf_model(path: str, dtype: str = "float32", reader=None) -> LlamaForCausalLM:
    """The model of a GGUF file, on jax.devices()[0], parameters and activations in dtype."""
    from pagedjax.models.loading.names import EXPERT, expert_names, hf_weight_name

    abstract, opened, _ = checked_gguf(path, dtype, reader)
    np_dtype = np.dtype(jnp.dtype(dtype))
    state = nnx.state(abstract, nnx.Param)
    params = nnx.to_pure_dict(state)
    with opened() as tensor:
        def read(p, _):
            name, transpose = hf_weight_name(p)
            parts = [np.ascontiguousarray(w.T if transpose else w, np_dtype)
                     for w in map(tensor, expert_names(name, abstract.config.num_experts))]
            weight = np.stack(parts) if EXPERT in name else parts[0]
            return jax.device_put(weight, jax.devices()[0])

        loaded = jax.tree_util.tree_map_with_path(read, params)
    nnx.replace_by_pure_dict(state, loaded)
    nnx.update(abstract, state)
    return abstract
