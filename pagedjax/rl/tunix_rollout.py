"""pagedjax as a Tunix rollout engine: `ClusterConfig(rollout_engine=PagedJaxRollout)` (Tunix's
`BaseRollout`, `tunix/rl/rollout/base_rollout.py`), beside its "vanilla", "vllm" and
"sglang_jax" ones. Needs google-tunix (`make test-tunix` builds a virtual environment with it).

- `generate(prompts, rollout_config)`: the prompts tokenized as Tunix's sampler does (BOS, then
  the text), sampled by the paged engine with the config's temperature, top-p, top-k, seed,
  max tokens and EOS tokens; the completions' tokens (EOS excluded), text, the sampled tokens'
  log-probs (`return_logprobs`: the model's, before any processing) and the prompts left-padded
  to `max_prompt_length` with the pad id, as Tunix's own rollout returns them (`logits`: an
  empty list: the engine keeps no full logits; Tunix's learners do not read them).
- `get_per_token_logps(prompt_tokens, completion_tokens)`: each completion teacher-forced
  through the engine's paged forward (prompt log-probs of the prompt + completion), zero past
  the completion's EOS (or, without one, over its right padding), as
  `tunix.rl.common.compute_per_token_logps` masks them.
- `update_params(params)`: Tunix's Llama 3 / Qwen 3 parameter state mapped onto pagedjax's
  (`pagedjax.rl.tunix_mapping`) and written into the engine in place (`LLM.update_weights`: no
  restart, no recompile, the prefix cache keyed by the new version).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

try:  # an optional extra: pip install pagedjax[tunix]
    from tunix.rl.rollout import base_rollout
except ImportError as error:  # pragma: no cover - where google-tunix is not installed
    raise ImportError("pagedjax.rl.tunix_rollout needs google-tunix (pip install "
                      "'pagedjax[tunix]', or requirements/tunix.txt)") from error

from pagedjax.frontend.llm import LLM
from pagedjax.models.registry import init_model
from pagedjax.rl.tunix_mapping import config_of, pagedjax_state
from pagedjax.scheduler import SamplingParams


class PagedJaxRollout(base_rollout.BaseRollout):
    """A Tunix rollout worker over a pagedjax engine (the module docstring)."""

    def __init__(self, rollout_actor, tokenizer, mesh=None, rollout_config=None,
                 **engine_kwargs):
        """rollout_actor: a Tunix Llama 3 or Qwen 3 model; tokenizer: Tunix's
        TokenizerAdapter; mesh: the rollout mesh (its size is the engine's tensor parallelism
        unless rollout_config names one); engine_kwargs: EngineConfig's fields."""
        self._tokenizer, self.mesh = tokenizer, None
        # the policy's structure, shapes only: its weights live in the engine (model())
        self._abstract_actor = nnx.eval_shape(lambda: rollout_actor)
        config = config_of(rollout_actor)
        state = nnx.state(rollout_actor, nnx.Param)
        dtype = jax.tree.leaves(state)[0].dtype
        model = nnx.eval_shape(lambda: init_model(config, dtype=dtype, param_dtype=dtype))
        nnx.update(model, pagedjax_state(state, model))
        if rollout_config is not None:
            if rollout_config.tensor_parallel_size > 0:
                engine_kwargs.setdefault("tensor_parallel_size",
                                         rollout_config.tensor_parallel_size)
        if mesh is not None and mesh.size > 1:
            engine_kwargs.setdefault("tensor_parallel_size", mesh.size)
        engine_kwargs.setdefault("dtype", str(np.dtype(dtype)) if dtype != jax.numpy.bfloat16
                                 else "bfloat16")
        self.llm = LLM(model, **engine_kwargs)
        self._version = 0

    # ---- BaseRollout ----------------------------------------------------------------------

    def generate(self, prompts, rollout_config, **kwargs) -> base_rollout.RolloutOutput:
        if kwargs:
            raise ValueError(f"PagedJaxRollout.generate: unknown arguments {sorted(kwargs)}")
        ids = [self._tokenize(p) for p in prompts]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in ids],
                                 self._sampling(rollout_config), use_tqdm=False)
        eos = set(self._eos_ids(rollout_config))
        tokens = [np.array([t for t in o.outputs[0].token_ids if t not in eos], np.int32)
                  for o in outs]
        logprobs = None
        if rollout_config.return_logprobs:
            logprobs = [np.array([step[t].logprob for step, t in zip(o.outputs[0].logprobs,
                                                                     o.outputs[0].token_ids)
                                  if t not in eos], np.float32) for o in outs]
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in tokens], logits=[],
            tokens=tokens, left_padded_prompt_tokens=self._left_padded(
                ids, rollout_config.max_prompt_length),
            logprobs=logprobs)

    def get_per_token_logps(self, prompt_tokens, completion_tokens):
        prompts, completions = np.asarray(prompt_tokens), np.asarray(completion_tokens)
        pad, eos = self.pad_id(), self.eos_id()
        rows, lengths = [], []
        for prompt, completion in zip(prompts, completions):
            prompt = prompt[np.argmax(prompt != pad):] if (prompt != pad).any() else prompt[:0]
            ends = np.nonzero(completion == eos)[0]
            if len(ends):  # through the first EOS, as Tunix's completion mask
                length = int(ends[0]) + 1
            else:  # no EOS: the tokens before the right padding
                real = np.nonzero(completion != pad)[0]
                length = int(real[-1]) + 1 if len(real) else 0
            rows.append({"prompt_token_ids": [int(t) for t in prompt]
                         + [int(t) for t in completion[:length]]})
            lengths.append(length)
        outs = self.llm.generate(rows, SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                      temperature=0.0), use_tqdm=False)
        logps = np.zeros(completions.shape, np.float32)
        for i, (out, length) in enumerate(zip(outs, lengths)):
            ids = rows[i]["prompt_token_ids"]
            start = len(ids) - length
            logps[i, :length] = [out.prompt_logprobs[p][ids[p]].logprob
                                 for p in range(start, len(ids))]
        return jax.numpy.asarray(logps)

    def update_params(self, params, filter_types=None) -> None:
        if filter_types is not None and any(t is not nnx.Param for t in filter_types):
            raise ValueError(f"PagedJaxRollout.update_params: only the whole model's "
                             f"parameters (nnx.Param) are served, got {filter_types} (LoRA "
                             f"adapters are not served yet)")
        if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(params)):
            raise ValueError("PagedJaxRollout.update_params: abstract parameters (Tunix's "
                             "offload_to_cpu hands model()'s back; the engine keeps its own "
                             "weights: leave offload_to_cpu off, or sleep the engine)")
        state = pagedjax_state(params, self._abstract())
        self._version += 1
        self.llm.update_weights(state, version=str(self._version))

    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self):
        """The policy's Tunix model, shapes only (nnx.eval_shape): the weights the engine
        serves are in its own buffers, written by update_params, so Tunix syncs them after
        every optimizer step (it skips the sync for a rollout sharing the trainer's arrays)."""
        return self._abstract_actor

    # ---- internals ------------------------------------------------------------------------

    def _abstract(self):
        engine = self.llm.engine
        dtype = jax.numpy.dtype(engine.config.dtype)
        return nnx.eval_shape(lambda: init_model(engine.model_config, dtype=dtype,
                                                 param_dtype=dtype))

    def _tokenize(self, prompt: str) -> list[int]:
        """As Tunix's sampler tokenizes (tunix.generate.sampler.Sampler.tokenize)."""
        bos = self._tokenizer.bos_id()
        ids = ([bos] if bos else []) + list(self._tokenizer.encode(prompt))
        return list(self._tokenizer.dedup_bos_ids(ids))

    def _eos_ids(self, rollout_config) -> list[int]:
        return list(rollout_config.eos_tokens or [self.eos_id()])

    def _sampling(self, rollout_config) -> SamplingParams:
        seed = rollout_config.seed
        if seed is not None and not isinstance(seed, int):
            seed = int(np.asarray(jax.random.key_data(seed) if jax.dtypes.issubdtype(
                seed.dtype, jax.dtypes.prng_key) else seed).ravel()[-1])
        greedy = rollout_config.top_p is None  # Tunix's sampler: no top_p is greedy decoding
        return SamplingParams(
            max_tokens=rollout_config.max_tokens_to_generate,
            temperature=0.0 if greedy else rollout_config.temperature,
            top_p=1.0 if greedy else rollout_config.top_p,
            top_k=-1 if rollout_config.top_k is None else rollout_config.top_k,
            seed=seed, stop_token_ids=tuple(self._eos_ids(rollout_config)), ignore_eos=False,
            logprobs=0 if rollout_config.return_logprobs else None)

    def _left_padded(self, ids: list[list[int]], length: int) -> np.ndarray:
        """The prompts left-padded to length, or (a longer one) to the power of two above the
        longest, as Tunix's sampler pads them."""
        longest = max(len(row) for row in ids)
        if longest > length:
            length = 1 << (longest - 1).bit_length()
        out = np.full((len(ids), length), self.pad_id(), np.int32)
        for i, row in enumerate(ids):
            out[i, length - len(row):] = row
        return out
