"""pagedjax.text.tokenizer: loading, chat templates (against transformers' own rendering), streaming
detokenization and stop strings. Tokenizers are trained here in memory; nothing is downloaded."""

import json
import random

import pytest
from helpers import ROLE_TEMPLATE
from tokenizer_builders import (LLAMA3_SPECIALS, LLAMA3_TEMPLATE, WORDS, corpus, train_byte_level,
                                write_dir)

from pagedjax.text.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pagedjax.text.tokenizer import ByteTokenizer, Tokenizer, render_chat_template

tokenizers = pytest.importorskip("tokenizers")

# Block tags on their own lines (trim_blocks / lstrip_blocks), namespace, tojson, tools, break.
BLOCKS_TEMPLATE = """\
{%- set ns = namespace(turns=0) -%}
{{ bos_token }}
{% if tools is not none %}
Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
<<SYS>> {{ message['content'] | trim }} <</SYS>>
    {% else %}
        {% set ns.turns = ns.turns + 1 %}
[{{ message['role'] | upper }} {{ ns.turns }}] {{ message['content'] }}
        {{- eos_token if message.role == 'assistant' }}
    {% endif %}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT]
{% endif %}
"""
MESSAGES = [{"role": "system", "content": "  You are terse. Ünïcödé 東京  "},
            {"role": "user", "content": "Hi 😀, what is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And café au lait?"}]


def train_metaspace():
    """Llama-2-like: SentencePiece "▁" spaces, BPE with <0xNN> byte fallback for the characters
    left out of its alphabet (CJK, emoji), no post-processor (add_bos_token in the config)."""
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(corpus(1), trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<s>", "</s>"], limit_alphabet=40, show_progress=False))
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    data["model"]["byte_fallback"] = True
    tok = tokenizers.Tokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(),
                                     decoders.Metaspace(replacement="▁", prepend_scheme="always")])
    return tok


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    tok = train_byte_level()
    ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIALS}
    config = {"chat_template": LLAMA3_TEMPLATE, "bos_token": "<|begin_of_text|>",
              "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": True}}
    generation = {"bos_token_id": ids["<|begin_of_text|>"],
                  "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}
    return write_dir(tmp_path_factory.mktemp("bpe") / "model", tok, config, generation)


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory):
    config = {"chat_template": BLOCKS_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>",
              "add_bos_token": True}
    return write_dir(tmp_path_factory.mktemp("sp") / "model", train_metaspace(), config)


@pytest.fixture(scope="module")
def bpe(bpe_dir):
    return Tokenizer.from_dir(bpe_dir)


@pytest.fixture(scope="module")
def sp(sp_dir):
    return Tokenizer.from_dir(sp_dir)


def load_tokenizer_json(path):
    return tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))


def hf_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path))


# --- loading, encode / decode -------------------------------------------------------------------

def test_round_trip_and_special_ids(bpe, sp, bpe_dir, sp_dir):
    transformers = pytest.importorskip("transformers")
    text = "Größe 東京 naïve 😀 🇯🇵 the fox"
    # sp's tokenizer.json has no post-processor: add_bos_token adds the BOS, as transformers does
    # when given add_bos_token (from_pretrained drops the flag when there is a tokenizer.json)
    hf_sp = transformers.PreTrainedTokenizerFast(tokenizer_file=str(sp_dir / "tokenizer.json"),
                                                 bos_token="<s>", add_bos_token=True)
    for tok, hf in ((bpe, hf_tokenizer(bpe_dir)), (sp, hf_sp)):
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False).endswith(text)
        assert ids == hf.encode(text)
        assert None not in tok.convert_ids_to_tokens(ids)
    assert any(t.startswith("<0x") for t in sp.convert_ids_to_tokens(sp.encode("東京")))  # fallback
    assert bpe.convert_ids_to_tokens(bpe.eos_token_ids) == ["<|end_of_text|>", "<|eot_id|>"]
    assert bpe.convert_ids_to_tokens([bpe.bos_token_id]) == ["<|begin_of_text|>"]
    assert bpe.vocab_size == 300 and sp.convert_ids_to_tokens(sp.eos_token_ids) == ["</s>"]


def test_tokenizer_json_post_processor_wins_over_add_bos_token(tmp_path, bpe_dir):
    config = {**json.loads((bpe_dir / "tokenizer_config.json").read_text()), "add_bos_token": False}
    path = write_dir(tmp_path / "model", load_tokenizer_json(bpe_dir), config)
    ids = Tokenizer.from_dir(path).encode("the fox")
    assert ids[0] == 0 and ids == hf_tokenizer(path).encode("the fox")


def test_load_errors(tmp_path, bpe_dir):
    with pytest.raises(ValueError, match="tokenizer.json not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json could not be loaded"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ValueError, match="eos_token_id"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 5}')
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}]}))
    with pytest.raises(ValueError, match="no template named 'default'"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == (5,) and tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


# --- chat templates ------------------------------------------------------------------------------

@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", ["bpe", "sp"])
def test_chat_template_matches_transformers(name, add_generation_prompt, request):
    path = request.getfixturevalue(f"{name}_dir")
    ours, theirs = Tokenizer.from_dir(path), hf_tokenizer(path)
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(MESSAGES, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    prompted = "assistant<|end_header_id|>" in text[-30:] or "[ASSISTANT]" in text
    assert prompted == add_generation_prompt
    ids = ours.apply_chat_template(MESSAGES, add_generation_prompt, tokenize=True)
    assert ids == ours.encode(text, add_special_tokens=False) and ids[0] == ours.bos_token_id


def test_chat_template_extra_variables_match_transformers(sp_dir):
    tools = [{"name": "get_weather", "description": "Wetter für 東京 ☀",
              "parameters": {"city": "str"}}]
    messages = MESSAGES[:2] + [{"role": "user", "content": "STOP"}] + MESSAGES[2:]  # {% break %}
    text = Tokenizer.from_dir(sp_dir).apply_chat_template(messages, tools=tools)
    assert text == hf_tokenizer(sp_dir).apply_chat_template(messages, tools=tools, tokenize=False,
                                                            add_generation_prompt=True)
    assert '"description": "Wetter für 東京 ☀"' in text and "And café" not in text


@pytest.mark.parametrize("form", ["named_list", "jinja_file"])
def test_chat_template_forms_match_transformers(form, tmp_path, bpe_dir):
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    jinja = None
    if form == "named_list":
        config["chat_template"] = [{"name": "tool_use", "template": "TOOLS"},
                                   {"name": "default", "template": BLOCKS_TEMPLATE}]
    else:  # transformers 5 writes the template to chat_template.jinja; it wins over the config
        config["chat_template"], jinja = "CONFIG TEMPLATE", BLOCKS_TEMPLATE
    path = write_dir(tmp_path / "model", load_tokenizer_json(bpe_dir),
                     config, jinja=jinja)
    ours = Tokenizer.from_dir(path)
    assert ours.chat_template == BLOCKS_TEMPLATE
    assert ours.apply_chat_template(MESSAGES) == hf_tokenizer(path).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


def test_chat_template_errors(bpe):
    for messages, match in [
            ([], "non-empty"), ("hi", "non-empty"), (["hi"], r"messages\[0\] must be a dict"),
            ([{"role": "user"}], r"messages\[0\]\['content'\] must be a str, got nothing"),
            (MESSAGES[:1] + [{"role": 3, "content": "x"}], r"messages\[1\]\['role'\].*got int")]:
        with pytest.raises(ValueError, match=match):
            bpe.apply_chat_template(messages)
    template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('Only user and assistant roles are supported!') }}"
                "{% endif %}{% endfor %}{{ strftime_now('%Y') }}")
    with pytest.raises(ValueError, match="Only user and assistant roles are supported!"):
        render_chat_template(template, MESSAGES, True)
    assert render_chat_template(template, MESSAGES[1:], True).isdigit()
    with pytest.raises(ValueError, match="does not compile"):
        render_chat_template("{% for %}", MESSAGES, True)
    for escape in ["{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}",
                   "{% set ns = namespace() %}{% set ns._x = 1 %}"]:
        with pytest.raises(ValueError, match="chat template failed"):  # the sandbox refuses
            render_chat_template(escape, MESSAGES, True)


# --- ByteTokenizer -------------------------------------------------------------------------------

def test_byte_tokenizer():
    tok = ByteTokenizer()
    text = "héllo 東京 😀"
    ids = tok.encode(text)
    assert ids == [256, *text.encode("utf-8")] and tok.decode(ids) == text
    assert tok.encode("a<eos>b", add_special_tokens=False) == [97, 257, 98]
    assert tok.decode([256, 104, 257, 260], False) == "<bos>h<eos><reserved_260>"
    assert tok.decode([256, 104, 257, 260]) == "h"
    assert tok.decode([0xE6, 0x9D, 104]) == "\ufffdh"
    assert tok.convert_ids_to_tokens([104, 10, 256, 999]) == ["h", "<0x0A>", "<bos>", None]
    assert (tok.vocab_size, tok.eos_token_ids, tok.bos_token_id) == (264, (257,), 256)
    with pytest.raises(ValueError, match="token id 264 is outside the vocabulary"):
        tok.decode([264])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 😀"}]
    with pytest.raises(ValueError, match="no chat template"):  # none made up for it
        tok.apply_chat_template(messages)
    text = tok.apply_chat_template(messages, chat_template=ROLE_TEMPLATE)
    assert text == "<bos>system: be brief\nuser: hi 😀\nassistant: "
    assert tok.apply_chat_template(messages, False, chat_template=ROLE_TEMPLATE) \
        == text.removesuffix("assistant: ")
    ids = tok.apply_chat_template(messages, tokenize=True, chat_template=ROLE_TEMPLATE)
    assert ids[0] == 256 and ids.count(256) == 1 and tok.decode(ids, False) == text


# --- IncrementalDetokenizer ----------------------------------------------------------------------

def stream(tok, ids, rng, prompt=(), skip_special_tokens=True):
    """Push `ids` in random chunks; the deltas (finish() last)."""
    detok = IncrementalDetokenizer(tok, list(prompt), skip_special_tokens)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    return deltas + [detok.finish()]


def text_ids(tok, rng):
    """Ids of random text, encoded in pieces (so merges and specials meet at odd places)."""
    ids = []
    for _ in range(rng.randint(1, 6)):
        ids += tok.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))),
                          add_special_tokens=rng.random() < 0.3)
    return ids


@pytest.mark.parametrize("name", ["bpe", "sp", "byte"])
def test_detokenizer_matches_full_decode(name, request):
    tok = ByteTokenizer() if name == "byte" else request.getfixturevalue(name)
    rng = random.Random(0)
    for trial in range(300):
        skip = trial % 2 == 0
        ids = text_ids(tok, rng)
        deltas = stream(tok, ids, rng, skip_special_tokens=skip)
        assert "".join(deltas) == tok.decode(ids, skip) and "\ufffd" not in "".join(deltas)
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]  # any ids at all
        full = tok.decode(ids, skip)
        if name != "sp" or "\ufffd" not in full:  # ByteFallback turns a run of invalid bytes into
            # one U+FFFD per byte only once it sees the whole run: not local
            assert "".join(stream(tok, ids, rng, skip_special_tokens=skip)) == full


@pytest.mark.parametrize("name", ["bpe", "sp", "byte"])
def test_detokenizer_holds_split_characters(name, request):
    tok = ByteTokenizer() if name == "byte" else request.getfixturevalue(name)
    ids = tok.encode("ok 😀 東京", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.finish()]
    assert "".join(deltas) == "ok 😀 東京" and all("\ufffd" not in d for d in deltas)
    assert len(ids) > len(deltas) - deltas.count("") - 1  # some characters span several tokens
    assert "😀" in [d.strip() for d in deltas]  # emitted whole, once complete
    if name == "byte":
        detok = IncrementalDetokenizer(tok)
        assert [detok.push([b]) for b in "😀".encode()] == ["", "", "", "😀"]
        assert detok.push([0xF0, 0x9F]) == "" and detok.finish() == "\ufffd"


def test_detokenizer_spaces_come_from_context(sp):
    prompt = sp.encode("the quick fox")
    out = sp.encode("jumps over", add_special_tokens=False)
    assert "".join(sp.decode([i]) for i in out) != sp.decode(out)  # per-token decoding loses spaces
    detok = IncrementalDetokenizer(sp, prompt)
    text = "".join(detok.push([i]) for i in out) + detok.finish()
    assert text == " jumps over" == sp.decode(prompt + out)[len(sp.decode(prompt)):]
    detok = IncrementalDetokenizer(sp)  # no prompt: the leading space goes, as in decode(out)
    assert "".join(detok.push([i]) for i in out) == "jumps over"


def test_detokenizer_decodes_only_a_window():
    class Counting(ByteTokenizer):
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            self.longest = max(self.longest, len(ids))
            return super().decode(ids, skip_special_tokens)

    tok = Counting()
    detok = IncrementalDetokenizer(tok, list(range(65, 91)) * 40)
    text = "".join(detok.push([b]) for b in ("é东😀x" * 300).encode())
    assert text == "é东😀x" * 300 and tok.longest <= 10


# --- StopStringMatcher ---------------------------------------------------------------------------

@pytest.mark.parametrize("include, expected", [(False, 6), (True, 10)])
def test_stop_truncation(include, expected):
    matcher = StopStringMatcher(["STOP", "\n\n"], include_stop_str_in_output=include)
    assert matcher.check("hello STOP world STOP", 21) == expected
    assert matcher.check("hello world", 11) is None
    assert matcher.check("xabcdx", 6) is None
    # the match that ends first wins, the longest on a tie
    assert StopStringMatcher(["abcd", "bc"], include).check("xabcdx", 6) == (4 if include else 2)
    assert StopStringMatcher(["b", "ab"], include).check("xab", 3) == (3 if include else 1)
    # a stop string at the very start of the text (the first delta)
    assert StopStringMatcher(["ab"], include).check("abc", 3) == (2 if include else 0)


def test_stop_string_split_across_deltas():
    matcher = StopStringMatcher(["<|im_end|>"])
    text, seen = "", []
    for delta in ["Hi th", "ere <|i", "m_", "end|> trailing"]:
        text += delta
        assert matcher.check(text, len(delta)) is None or delta.startswith("end")
        seen.append(matcher.holdback(text))
    assert seen[:3] == [0, 3, 5]
    assert matcher.check(text, len("end|> trailing")) == len("Hi there ")
    assert matcher.check("<|im_end|> old match", 5) is None  # a match must end in the new text


def test_stop_holdback_and_validation():
    matcher = StopStringMatcher(["aaa", "xyz"])
    texts = ["", "b", "ba", "baa", "bx", "bxy", "xyzb"]
    assert [matcher.holdback(t) for t in texts] == [0, 0, 1, 2, 1, 2, 0]
    for bad in ["STOP", [""], ["ok", 3], None]:
        with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
            StopStringMatcher(bad)
    with pytest.raises(ValueError, match="new_len"):
        matcher.check("abc", 4)
    assert StopStringMatcher([]).check("anything", 3) is None
