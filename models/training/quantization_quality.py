"""The quality a quantized model keeps, against the model it was quantized from, measured on
the dense forward (pagedjax.models.families.llama: the same weights the engine serves, no scheduling):

- logit error: |logits - reference logits| over every position, its mean and max, and the mean
  relative to the reference logits' standard deviation (scale-free across models);
- greedy agreement: teacher-forced, the share of generated positions where both models'
  argmax agree, along the reference's own greedy continuation (no divergence compounding);
- NLL: the mean next-token negative log-likelihood of a fixed text (in nats).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.models.training.generate import _dense_logits, dense_greedy_generate

# The fixed prompts and text a real model's report uses (benchmarks/quantization.py, the tests).
PROMPTS = ("The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three primary colors are",
           "Water boils at a temperature of", "import numpy as np\n",
           "The largest planet in the solar system is", "To make a cup of tea, first")
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg developed a system of movable metal type in Mainz. His press made books far "
        "cheaper to produce, and within decades printing shops had spread across Europe, "
        "changing how knowledge was shared.")


def _logits(model, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """f32[len, V] per sequence (each padded to the longest: causal attention leaves the
    real positions as they are)."""
    longest = max(len(s) for s in sequences)
    tokens = np.zeros((len(sequences), longest), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, :len(s)] = s
    out = np.asarray(_dense_logits(model, jnp.asarray(tokens)), np.float32)
    return [out[i, :len(s)] for i, s in enumerate(sequences)]


def quality(reference, model, prompts: Sequence[Sequence[int]], max_tokens: int,
            text_tokens: Sequence[int]) -> dict:
    """The module docstring's measures of model against reference: prompts continued greedily
    by reference for max_tokens, text_tokens scored for NLL by both."""
    continuations = dense_greedy_generate(reference, prompts, max_tokens)
    sequences = [list(p) + c for p, c in zip(prompts, continuations)]
    ref, got = _logits(reference, sequences), _logits(model, sequences)
    errors = np.concatenate([np.abs(a - b).reshape(-1) for a, b in zip(ref, got)])
    spread = float(np.mean([a.std() for a in ref]))
    agree = np.concatenate([np.argmax(b[len(p) - 1:-1], -1) == np.asarray(c)
                            for p, c, b in zip(prompts, continuations, got)])
    return {"logit_error_mean": float(errors.mean()), "logit_error_max": float(errors.max()),
            "logit_error_rel": float(errors.mean() / spread),
            "greedy_agreement": float(agree.mean()), "positions": int(agree.size),
            "nll": nll(model, text_tokens), "nll_reference": nll(reference, text_tokens)}


def nll(model, tokens: Sequence[int]) -> float:
    """Mean next-token negative log-likelihood of tokens (nats)."""
    logits = _logits(model, [list(tokens)])[0][:-1]
    logprobs = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    return float(-np.mean(logprobs[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]))
