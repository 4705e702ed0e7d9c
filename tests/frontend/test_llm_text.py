"""Text in, text out: LLM(model=dir) on a Hugging Face directory with a tokenizer (both built in
the test), stop strings, generation_config stop ids, chat, and the orbax training-to-serving
path. Token-level references come from transformers on the same weights."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import ROLE_TEMPLATE, until_done

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenizer_builders import LLAMA3_SPECIALS, LLAMA3_TEMPLATE, train_byte_level  # noqa: E402

from pagedjax import LLM, SamplingParams  # noqa: E402
from pagedjax.models import get_config, init_model  # noqa: E402
from pagedjax.models.loading.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pagedjax.models.loading.hf import load_hf_model  # noqa: E402
from pagedjax.text.tokenizer import Tokenizer  # noqa: E402

PROMPTS = ["the quick brown fox", "café 東京 😀 and", "a"]
ENGINE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, min_seq_bucket=4)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Llama with a trained byte-level BPE tokenizer and a Llama-3 chat template."""
    path = tmp_path_factory.mktemp("hf") / "model"
    tok = train_byte_level()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        initializer_range=0.2, max_position_embeddings=128, bos_token_id=0,
        eos_token_id=tok.token_to_id("<|eot_id|>"))
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": LLAMA3_TEMPLATE, "bos_token": LLAMA3_SPECIALS[0],
        "eos_token": "<|eot_id|>"}))
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **ENGINE)


def hf_greedy(model_dir, ids, max_tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                             do_sample=False, max_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_directory_picks_hf_loader_and_tokenizer(llm, model_dir):
    assert isinstance(llm.tokenizer, Tokenizer)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt)
        assert out.prompt == prompt and out.prompt_token_ids == ids
        assert out.output_token_ids == hf_greedy(model_dir, ids, GREEDY.max_tokens)
        assert out.text == llm.tokenizer.decode(out.output_token_ids)
    # token ids and {"prompt_token_ids": ...} give the same tokens, with no prompt text
    same = llm.generate([{"prompt_token_ids": outs[0].prompt_token_ids}], GREEDY,
                        use_tqdm=False)[0]
    assert same.output_token_ids == outs[0].output_token_ids and same.prompt is None


def test_generate_takes_vllms_prompt_forms_mixed(llm):
    """A string, {"prompt": str}, token ids, {"prompt_token_ids": [...]} (with and without its
    text) in one call: each its own tokens, in order."""
    ids = llm.tokenizer.encode(PROMPTS[1])
    forms = [PROMPTS[0], {"prompt": PROMPTS[1]}, ids, {"prompt_token_ids": ids},
             {"prompt_token_ids": ids, "prompt": PROMPTS[1]}]
    outs = llm.generate(forms, GREEDY, use_tqdm=False)
    alone = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS[:2]]
    assert outs[0].output_token_ids == alone[0].output_token_ids
    assert all(o.output_token_ids == alone[1].output_token_ids for o in outs[1:])
    assert [o.prompt for o in outs] == [PROMPTS[0], PROMPTS[1], None, None, PROMPTS[1]]
    for bad, words in (({"prompt": 3}, "prompt must be a string"),
                       ({"text": "x"}, "a prompt dict holds prompt")):
        with pytest.raises(ValueError, match=words):
            llm.generate([PROMPTS[0], bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # a rejected call queued nothing


def long_text_output(llm):
    """A prompt whose greedy text is long enough to hold a stop string in its middle."""
    for prompt in PROMPTS:
        out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        if len(out.text) >= 12:
            return prompt, out
    pytest.skip("no greedy output of 12+ characters")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_and_stops_early(llm, include):
    prompt, full = long_text_output(llm)
    stop = full.text[6:9]
    start = full.text.index(stop)
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=[stop],
                            include_stop_str_in_output=include)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:start + (len(stop) if include else 0)]
    assert len(out.output_token_ids) < len(full.output_token_ids)
    assert out.output_token_ids == full.output_token_ids[:len(out.output_token_ids)]
    assert out.outputs[0].stop_reason == stop  # vLLM's stop_reason: the string that matched
    assert full.outputs[0].stop_reason is None  # the length limit


def test_stop_token_id_is_the_stop_reason(llm):
    prompt, full = long_text_output(llm)
    token = full.output_token_ids[3]
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[token])
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == token
    assert out.output_token_ids == full.output_token_ids[:full.output_token_ids.index(token) + 1]


def test_streamed_text_never_shows_a_stop_string(llm):
    prompt, full = long_text_output(llm)
    stop = full.text[6:9]
    engine = llm.engine
    request_id = engine.add_request(llm.tokenizer.encode(prompt),
                                    SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]))
    seen = []
    for _ in until_done(engine):
        for out in engine.step():
            assert out.request_id == request_id
            seen.append(out.text)
    final = seen[-1]
    assert stop not in final and final == full.text[:full.text.index(stop)]
    for earlier, later in zip(seen, seen[1:]):  # a stream only ever appends
        assert later.startswith(earlier)


def test_generation_config_eos_ids_stop(model_dir, tmp_path):
    """generation_config.json may name several eos ids; any of them ends a request."""
    prompt = PROMPTS[0]
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode(prompt)
    greedy = hf_greedy(model_dir, ids, 8)
    stop_id = greedy[3]
    assert stop_id not in greedy[:3]
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, stop_id]}))
    out = LLM(str(copy), **ENGINE).generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.output_token_ids == greedy[:4] and out.finish_reason == "stop"


def test_chat_renders_the_template_like_transformers(llm, model_dir):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi 😀"}]
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected_ids = hf_tok.encode(text, add_special_tokens=False)
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == expected_ids
    assert out.output_token_ids == hf_greedy(model_dir, expected_ids, GREEDY.max_tokens)
    batch = llm.chat([messages, messages[1:]], GREEDY, use_tqdm=False)
    assert batch[0].output_token_ids == out.output_token_ids and len(batch) == 2
    own = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=ROLE_TEMPLATE)[0]
    assert own.prompt_token_ids == hf_tok.encode(hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, chat_template=ROLE_TEMPLATE),
        add_special_tokens=False)


def test_text_input_errors_leave_the_engine_serving(llm):
    with pytest.raises(ValueError, match="stop must hold non-empty strings"):
        SamplingParams(stop=[""])
    no_tokenizer = LLM(init_model(get_config("debug-tiny")), **ENGINE)
    with pytest.raises(ValueError, match="no tokenizer"):
        no_tokenizer.generate("hello", GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        no_tokenizer.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="chat needs a tokenizer"):
        no_tokenizer.chat([{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        llm.chat([{"role": "user"}])
    assert not llm.engine.has_unfinished()
    assert llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].finished


def test_unknown_model_names_and_directories(tmp_path):
    with pytest.raises(ValueError, match="neither pagedjax_config.json .* nor config.json"):
        LLM(str(tmp_path))
    with pytest.raises(ValueError, match="neither a directory nor a known config"):
        LLM("no-such-model")


def test_orbax_round_trip_serves_identical_outputs(llm, model_dir, tmp_path):
    """Training-to-serving: a model saved with pagedjax.models.loading.checkpoint (plus the tokenizer file) is
    served from the directory with the same tokens and text as the original."""
    checkpoint = tmp_path / "ckpt"
    save_checkpoint(load_hf_model(str(model_dir)), str(checkpoint), {"source": "test"})
    shutil.copy(model_dir / "tokenizer.json", checkpoint)
    shutil.copy(model_dir / "tokenizer_config.json", checkpoint)
    restored = LLM(str(checkpoint), **ENGINE)
    assert isinstance(restored.tokenizer, Tokenizer)
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=7)  # sampled: same key schedule
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    got = restored.generate(PROMPTS, params, use_tqdm=False)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]


def test_checkpoint_errors(tmp_path):
    model = init_model(get_config("debug-tiny"))
    save_checkpoint(model, str(tmp_path / "a"))
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        save_checkpoint(model, str(tmp_path / "a"))
    ids = np.arange(10)[None]
    np.testing.assert_array_equal(np.asarray(load_checkpoint(str(tmp_path / "a"))(ids)),
                                  np.asarray(model(ids)))
    config = json.loads((tmp_path / "a" / "pagedjax_config.json").read_text())
    config["model_config"]["hidden_size"] = 32  # the saved arrays no longer fit the config
    (tmp_path / "a" / "pagedjax_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cannot restore parameters"):
        load_checkpoint(str(tmp_path / "a"))
    shutil.rmtree(tmp_path / "a" / "params")
    with pytest.raises(ValueError, match="params/ is missing"):
        load_checkpoint(str(tmp_path / "a"))
    with pytest.raises(ValueError, match="not a pagedjax checkpoint"):
        load_checkpoint(str(tmp_path))


def test_a_loaded_checkpoint_compiles_each_program_once(model_dir):
    """Loaded weights are committed to a device (random init is not): the runner commits
    everything, so the second pass over the same shapes compiles nothing."""
    from pagedjax.engine.runner import num_step_traces
    from pagedjax.engine.sampling_step import num_sampler_compiles
    llm = LLM(str(model_dir), **ENGINE, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    llm.generate(rng.integers(3, 200, (3, 8)).tolist(), GREEDY, use_tqdm=False)
    before = num_step_traces(), num_sampler_compiles()
    llm.generate(rng.integers(3, 200, (3, 8)).tolist(), GREEDY, use_tqdm=False)
    assert (num_step_traces(), num_sampler_compiles()) == before
