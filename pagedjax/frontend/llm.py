"""LLM: the offline batch API, a thin layer over LLMEngine."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax.numpy as jnp
from tqdm.auto import tqdm

from pagedjax.engine.beam_search import BeamSearchParams, BeamSequence, beam_search
from pagedjax.engine.config import EngineConfig
from pagedjax.engine.encoder_engine import EncoderEngine
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import RequestOutput
from pagedjax.engine.request_checks import PromptSpec
from pagedjax.frontend.data_parallel import DataParallelEngine, make_engine
from pagedjax.frontend.llm_pooling import PoolingAPI
from pagedjax.frontend.pooling_setup import pooling_setup, resolve_runner
from pagedjax.frontend.prompt_inputs import prompt_input
from pagedjax.lora.request import LoRARequest
from pagedjax.models import CONFIGS, DEFAULT_CHECKPOINT, LlamaForCausalLM, get_config, init_model
from pagedjax.models.loading.encoder import is_encoder_dir
from pagedjax.models.loading.placed_weights import LazyModel
from pagedjax.scheduler import RequestError, SamplingParams
from pagedjax.text.tokenizer import NO_CHAT_TEMPLATE, ByteTokenizer, Tokenizer, check_chat_template

DEFAULT_MODEL = DEFAULT_CHECKPOINT  # the embedded trained model


def load_model(model: str | LlamaForCausalLM, seed: int = 0,
               dtype: str = "float32") -> LlamaForCausalLM:
    """A model from what `model` names (see resolve_model), without its tokenizer."""
    return resolve_model(model, seed, dtype)[0]


def resolve_model(model: str | os.PathLike | LlamaForCausalLM, seed: int = 0,
                  dtype: str = "float32", lazy: bool = False):
    """(model, tokenizer or None) for what `model` names, by what it is (lazy: a checkpoint
    comes back as a pagedjax.models.loading.placed_weights.LazyModel, checked but not read, which an engine reads
    straight into its devices' shardings):

    - a LlamaForCausalLM: used as is;
    - a directory with `pagedjax_config.json`: an orbax checkpoint from pagedjax.models.loading.checkpoint (the
      training-to-serving path); its tokenizer is the directory's tokenizer.json, or the byte
      vocabulary when the checkpoint's metadata says `"tokenizer": "byte"`;
    - a directory with `config.json`: a Hugging Face model (safetensors), with tokenizer.json;
    - a `.gguf` file (llama.cpp's format; pagedjax.models.loading.gguf): the Llama family, dequantized to
      dtype, with the tokenizer and chat template it embeds;
    - a name from models.CONFIGS: that config with seeded random weights (parameters in f32,
      activations in dtype), no tokenizer.
    """
    if isinstance(model, (LlamaForCausalLM, LazyModel)):
        return model, None
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a model directory, a config name or a "
                         f"LlamaForCausalLM, got {type(model).__name__}")
    path = os.fspath(model)
    compute_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
    from pagedjax.models.loading.gguf import is_gguf
    if is_gguf(path):
        from pagedjax.models.loading.gguf import (lazy_gguf_model, load_gguf_model, metadata,
                                                  open_gguf)
        from pagedjax.text.gguf_tokenizer import tokenizer_from_gguf
        reader = open_gguf(path)
        loaded = (lazy_gguf_model if lazy else load_gguf_model)(path, dtype, reader)
        return loaded, tokenizer_from_gguf(metadata(reader), path)
    if os.path.isdir(path):
        from pagedjax.models.loading.checkpoint import (is_checkpoint, load_checkpoint,
                                                        read_checkpoint_config)
        has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))
        tokenizer: Tokenizer | ByteTokenizer | None = Tokenizer.from_dir(path) if has_tokenizer else None
        if is_checkpoint(path):
            if lazy:
                from pagedjax.models.loading.placed_weights import lazy_checkpoint
                loaded = lazy_checkpoint(path, dtype=compute_dtype)
            else:
                loaded = load_checkpoint(path, dtype=compute_dtype)
            saved = read_checkpoint_config(path)[1].get("metadata", {})
            if tokenizer is None and saved.get("tokenizer") == "byte":
                tokenizer = ByteTokenizer()
            return loaded, tokenizer
        if os.path.isfile(os.path.join(path, "config.json")):
            if lazy:
                from pagedjax.models.loading.placed_weights import lazy_hf_model
                return lazy_hf_model(path, dtype=dtype), tokenizer
            from pagedjax.models.loading.hf import load_hf_model
            return load_hf_model(path, dtype=dtype), tokenizer
        raise ValueError(f"model directory {path} has neither pagedjax_config.json (an orbax "
                         f"checkpoint from pagedjax.models.loading.checkpoint) nor config.json (a Hugging Face "
                         f"model)")
    if path in CONFIGS:
        return init_model(get_config(path), seed=seed, dtype=compute_dtype), None
    raise ValueError(f"model {path!r} is neither a directory nor a known config "
                     f"({sorted(CONFIGS)})")


def per_prompt_loras(lora_request, num_prompts: int) -> list:
    """lora_request (one LoRARequest, None, or a list of one per prompt) as a list a prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)):
        raise RequestError("lora_request", f"lora_request must be a LoRARequest or a list of "
                           f"them, got {type(lora_request).__name__}")
    if len(lora_request) != num_prompts:
        raise RequestError("lora_request", f"lora_request has {len(lora_request)} entries for "
                           f"{num_prompts} prompts")
    return list(lora_request)


def checkpoint_for_update(engine, path):
    """A checkpoint path as update_weights reads it: straight into the engine's shardings (a
    LazyModel, each process its own shards), or whole when it must be quantized first (an
    orbax checkpoint for a quantized engine, as LLM reads one)."""
    lazy = engine.config.quantization is None or not _is_orbax(path)
    return resolve_model(path, dtype=engine.config.dtype, lazy=lazy)[0]


def checkpoint_dtype(model) -> str:
    """vLLM's dtype="auto": the engine dtype a checkpoint's own asks for. A Hugging Face
    directory stored in 16 bits (config.json's dtype / torch_dtype bfloat16 or float16) runs in
    bfloat16; everything else (float32 checkpoints, GGUF files, which are dequantized, orbax
    checkpoints, config names, model objects) in float32."""
    path = None if isinstance(model, (LlamaForCausalLM, LazyModel)) else os.fspath(model)
    config_file = None if path is None else os.path.join(path, "config.json")
    if config_file is None or not os.path.isfile(config_file):
        return "float32"
    from pagedjax.models.loading.user_files import read_user_json
    try:
        raw = read_user_json(config_file)
    except ValueError as error:
        raise ValueError(f"{config_file} could not be read: {error}") from None
    stored = raw.get("dtype") or raw.get("torch_dtype")
    return "bfloat16" if stored in ("bfloat16", "float16") else "float32"


def _is_orbax(model) -> bool:
    from pagedjax.models.loading.checkpoint import is_checkpoint
    return isinstance(model, (str, os.PathLike)) and os.path.isdir(model) and is_checkpoint(
        os.fspath(model))


def _load_tokenizer(tokenizer):
    if tokenizer is None or hasattr(tokenizer, "decode"):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        if os.fspath(tokenizer) == "byte":
            return ByteTokenizer()
        return Tokenizer.from_dir(tokenizer)
    raise ValueError(f"tokenizer must be a directory, 'byte' or a tokenizer object, "
                     f"got {type(tokenizer).__name__}")


class LLM(PoolingAPI):
    """Offline generation.

        llm = LLM("path/to/hf-or-orbax-dir")
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
        llm.chat([{"role": "user", "content": "Hi"}])
    """

    # engine: LLMEngine, DataParallelEngine (data_parallel_size > 1) or, for a BERT-like
    # encoder, EncoderEngine (pooling only)

    def __init__(self, model: str | os.PathLike | LlamaForCausalLM = DEFAULT_MODEL,
                 tokenizer: Any = None, **engine_kwargs):
        """engine_kwargs: EngineConfig's fields; dtype="auto" takes the checkpoint's
        (checkpoint_dtype). Its runner: "generate", "pooling" (embed, classify, score, reward:
        PoolingAPI) or "auto" (pooling for a classifier); pooler_config, hf_overrides:
        pagedjax.frontend.pooling_setup."""
        if engine_kwargs.get("dtype") == "auto":
            engine_kwargs["dtype"] = checkpoint_dtype(model)
        config = EngineConfig.from_kwargs(**engine_kwargs)
        config = dataclasses.replace(config, runner=resolve_runner(
            model, config.runner, config.hf_overrides, config.convert))
        if not isinstance(model, LlamaForCausalLM) and is_encoder_dir(model):  # BERT-like
            self._init_encoder(os.fspath(model), _load_tokenizer(tokenizer), config)
            return
        # a checkpoint read into place as it is quantized, unless its loader reads it whole
        # (orbax: read, then quantized: a transient full-precision copy)
        lazy = config.quantization is None or not _is_orbax(model)
        loaded, own_tokenizer = resolve_model(model, seed=config.seed, dtype=config.dtype,
                                              lazy=lazy)
        self.tokenizer = _load_tokenizer(tokenizer) or own_tokenizer
        pooling_model = pooling_setup(model, loaded, self.tokenizer, config.runner,
                                      config.pooler_config, config.hf_overrides,
                                      config.convert)
        spec = config.speculative
        draft = None if spec is None or spec.model is None else resolve_model(
            spec.model, seed=config.seed, dtype=config.dtype)[0]
        self.engine = make_engine(loaded, config, tokenizer=self.tokenizer, draft_model=draft)
        self._dtype = config.dtype
        self._init_runner(config.runner, pooling_model)

    def generate(self, prompts: str | Sequence[Any],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Generates for every prompt, vLLM's forms mixed as they come: a string (needs a
        tokenizer), a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]} (with
        an optional "prompt", its text); outputs come back in prompt order. lora_request: the
        LoRA adapter every prompt runs under, or a list of one per prompt (None: the base
        model; the engine needs enable_lora=True).

        Every request is validated before any is queued, so a bad one rejects the whole call and
        leaves the engine as it was.
        """
        self.check_runner("generate", "generate")
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise RequestError("prompts", "prompts must be a non-empty list of strings or "
                               "token-id lists")
        if isinstance(prompts[0], int):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise RequestError("sampling_params", f"sampling_params must be a SamplingParams or "
                               f"a list of them, got {type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise RequestError("sampling_params", f"sampling_params has {len(sampling_params)} entries for "
                             f"{len(prompts)} prompts")
        engine = self.generating("generate")
        if engine.is_paused:
            raise ValueError("generation is paused (pause_generation): resume_generation() "
                             "first")
        specs = []
        for prompt, params, lora in zip(prompts, sampling_params,
                                        per_prompt_loras(lora_request, len(prompts))):
            ids, text = prompt_input(self.tokenizer, prompt)
            specs.append(PromptSpec(ids, params, prompt_text=text, lora_request=lora))
        request_ids = engine.add_requests(specs)
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm) as bar:
            while engine.has_unfinished():
                for out in engine.step(final_only=True):
                    if isinstance(out, RequestOutput) and out.finished:
                        outputs[out.request_id] = out
                        bar.update(1)
        return [outputs[request_id] for request_id in request_ids]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             **template_kwargs) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages) or a
        list of them, rendered with chat_template, or else the tokenizer's own (a model without
        one is refused, as vLLM does: a made-up template would feed it garbage)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has none")
        if chat_template is not None:
            check_chat_template(chat_template)
        elif getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(NO_CHAT_TEMPLATE)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
            chat_template=chat_template, **template_kwargs)} for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts: Sequence[Sequence[int]], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    ) -> list[list[BeamSequence]]:
        """The params.beam_width best continuations of each prompt, best first (lora_request:
        as generate's)."""
        self.check_runner("generate", "beam_search")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if self.engine.has_unfinished():
            raise ValueError("beam_search needs an idle engine")
        return beam_search(self.generating("beam_search"),
                           [prompt_input(self.tokenizer, p)[0] for p in prompts], params,
                           per_prompt_loras(lora_request, len(prompts)))

    def generating(self, method: str) -> LLMEngine | DataParallelEngine:
        """The engine, for a control a BERT-like encoder's engine has not (it pools only)."""
        if isinstance(self.engine, EncoderEngine):
            raise ValueError(f"LLM.{method}: this model runs as a BERT-like encoder, which "
                             f"serves pooling only")
        return self.engine

    # ---- training to serving (issue 52: pagedjax.engine.weight_updates) ---------------------------

    def update_weights(self, weights, *, version: str | None = None, mode: str = "wait") -> None:
        """Serves new weights from now on, in place (nothing reloads, nothing recompiles): a
        model of the engine's config (a trainer's), its nnx.State, or a checkpoint path read as
        LLM reads its model (an orbax checkpoint, a Hugging Face directory, a GGUF file). mode:
        what the requests in flight do ("wait", "abort", "keep"); version: the weights' name,
        on every output from now on (default: the number of updates)."""
        if isinstance(weights, (str, os.PathLike)):
            weights = checkpoint_for_update(self.engine, weights)
        self.generating("update_weights").update_weights(weights, version=version, mode=mode)

    # ---- LoRA adapters (issue 53: pagedjax.lora) ---------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.generating("add_lora").add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.generating("remove_lora").remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.generating("list_loras").list_loras()

    def update_lora(self, name: str, weights, *, mode: str = "wait") -> None:
        """Adapter-only training-to-serving sync (LLMEngine.update_lora)."""
        self.generating("update_lora").update_lora(name, weights, mode=mode)

    def pause_generation(self, mode: str = "wait") -> None:
        self.generating("pause_generation").pause_generation(mode)

    def resume_generation(self) -> None:
        self.generating("resume_generation").resume_generation()

    def reset_prefix_cache(self) -> bool:
        """Forgets the cached blocks (False while requests hold blocks)."""
        return self.generating("reset_prefix_cache").reset_prefix_cache()

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    @property
    def is_paused(self) -> bool:
        return self.generating("is_paused").is_paused

    def sleep(self, level: int = 1) -> None:
        """Gives the device memory back while idle (pagedjax.engine.sleep_mode): level 1 keeps
        the weights in host memory, level 2 drops them (update_weights brings new ones)."""
        self.generating("sleep").sleep(level)

    def wake_up(self, tags=None) -> None:
        """The parts named ("weights", "kv_cache"; default both) back on the device."""
        self.generating("wake_up").wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.generating("is_sleeping").is_sleeping
