"""BERT (transformers' BertModel, and RoBERTa / XLM-RoBERTa's same encoder): a bidirectional
encoder people embed with, in Flax NNX. Dense only: every token attends to every other of its
sequence, so a sequence's states exist only once all of it is in; there is nothing to keep in
a KV cache, chunk, or share as a prefix, and its prompts are short (512 positions). The
engine runs it on padded [B, L] batches (pagedjax.engine.encoder_engine).

Post-norm layers: x = LN(x + attention(x)); x = LN(x + W2 gelu(W1 x)); absolute position
embeddings and token-type 0 added to the word embeddings, then normalized.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
ACTIVATIONS = {"gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
               "relu": jax.nn.relu}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    # RoBERTa numbers positions from padding_idx + 1 (position ids offset by it)
    position_offset: int = 0
    model_type: str = "bert"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def reads_token_types(self) -> bool:
        """BERT's segments (a cross-encoder's query 0, document 1); RoBERTa's tokenizers give
        none (its table holds type 0 only)."""
        return self.model_type == "bert" and self.type_vocab_size > 1

    @property
    def max_tokens(self) -> int:
        """The longest sequence its position table holds."""
        return self.max_position_embeddings - self.position_offset


def read_encoder_config(raw: dict) -> EncoderConfig:
    """config.json of a BERT-like encoder; ValueError naming what is not served."""
    model_type = raw.get("model_type")
    if model_type not in ENCODER_TYPES:
        raise ValueError(f"not a BERT-like encoder: model_type {model_type!r}")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{model_type}: position_embedding_type "
                         f"{raw['position_embedding_type']!r} is not served (absolute only)")
    act = raw.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{model_type}: hidden_act {act!r} is not served "
                         f"({', '.join(ACTIVATIONS)})")
    offset = raw.get("pad_token_id", 1) + 1 if model_type != "bert" else 0
    return EncoderConfig(raw["vocab_size"], raw["hidden_size"], raw["intermediate_size"],
                         raw["num_hidden_layers"], raw["num_attention_heads"],
                         raw["max_position_embeddings"], raw.get("type_vocab_size", 2),
                         raw.get("layer_norm_eps", 1e-12), act, offset, model_type)


class EncoderLayer(nnx.Module):
    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        d, f, eps = config.hidden_size, config.intermediate_size, config.layer_norm_eps
        self.config = config
        self.query, self.key, self.value = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
        self.attention_output = nnx.Linear(d, d, rngs=rngs)
        self.attention_norm = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)
        self.intermediate = nnx.Linear(d, f, rngs=rngs)
        self.output = nnx.Linear(f, d, rngs=rngs)
        self.output_norm = nnx.LayerNorm(d, epsilon=eps, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x [B, L, D], mask bool[B, L] (the real tokens)."""
        b, length, d = x.shape
        heads = self.config.num_heads
        split = lambda y: y.reshape(b, length, heads, d // heads)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scores = jnp.einsum("BLNH,BMNH->BNLM", q, k) / jnp.sqrt(jnp.float32(d // heads))
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
        context = jnp.einsum("BNLM,BMNH->BLNH", jax.nn.softmax(scores, axis=-1), v)
        x = self.attention_norm(x + self.attention_output(context.reshape(b, length, d)))
        hidden = ACTIVATIONS[self.config.hidden_act](self.intermediate(x))
        return self.output_norm(x + self.output(hidden))


class BertModel(nnx.Module):
    """last_hidden_state of transformers' BertModel (what sentence-transformers pools)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.config = config
        self.word_embeddings = nnx.Embed(config.vocab_size, d, rngs=rngs)
        self.position_embeddings = nnx.Embed(config.max_position_embeddings, d, rngs=rngs)
        self.token_type_embeddings = nnx.Embed(config.type_vocab_size, d, rngs=rngs)
        self.embedding_norm = nnx.LayerNorm(d, epsilon=config.layer_norm_eps, rngs=rngs)
        self.layers = nnx.List([EncoderLayer(config, rngs=rngs)
                                for _ in range(config.num_layers)])

    def __call__(self, token_ids: jax.Array, mask: jax.Array,
                 token_types: jax.Array | None = None) -> jax.Array:
        """token_ids i32[B, L] (padding anywhere mask is False), token_types i32[B, L] (None:
        all 0) -> f32[B, L, D]."""
        positions = jnp.arange(token_ids.shape[1]) + self.config.position_offset
        types = jnp.zeros_like(token_ids) if token_types is None else token_types
        x = (self.word_embeddings(token_ids) + self.position_embeddings(positions)[None]
             + self.token_type_embeddings(types))
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x, mask)
        return x
