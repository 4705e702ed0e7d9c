"""Tokenizers and chat templates (streaming detokenization and stop strings:
pagedjax.text.detokenizer).

`Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` loaded from a model directory;
`ByteTokenizer` is the byte-level vocabulary of the embedded model. Both render chat templates
the way transformers does and share one duck-typed interface (vocab_size, eos_token_ids,
bos_token_id, chat_template, encode, decode, convert_ids_to_tokens, apply_chat_template).
`tokenizers` and `jinja2` are imported only when first needed.
"""

from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import tokenizers

NO_TEMPLATE_VARS = {"tools": None, "documents": None}  # transformers always passes these
NO_CHAT_TEMPLATE = (  # vLLM refuses too: a made-up default template gives a model garbage
    "this model's tokenizer has no chat template (no chat_template in tokenizer_config.json, "
    "no chat_template.jinja, no tokenizer.chat_template in the GGUF); pass one "
    "(chat_template= / pagedjax serve --chat-template FILE) or send plain prompts "
    "(LLM.generate, /v1/completions)")

MAX_TEMPLATE_BYTES = 4 << 20  # a chat template file (the largest shipped are ~20 KB)


def check_chat_template(template: Any, field: str = "chat_template") -> str:
    """A template string that compiles, or ValueError naming `field`."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"{field} must be a non-empty Jinja template string, got {template!r}")
    _compile_chat_template(template)
    return template


TEMPLATES_DIR = os.path.join(os.path.dirname(__file__), "templates")


def shipped_templates() -> list[str]:
    """The names of the chat templates pagedjax ships (pagedjax/text/templates/NAME.jinja)."""
    return sorted(f[:-len(".jinja")] for f in os.listdir(TEMPLATES_DIR) if f.endswith(".jinja"))


def read_chat_template(value: str) -> str:
    """--chat-template: a file holding the template, the name of one pagedjax ships, or the
    template itself (as vLLM)."""
    if value in shipped_templates():
        value = os.path.join(TEMPLATES_DIR, f"{value}.jinja")
    if os.path.isfile(value):
        return check_chat_template(_read_text(value, "--chat-template file"),
                                   f"--chat-template file {value}")
    if not any(mark in value for mark in ("{{", "{%")):
        raise ValueError(f"--chat-template {value!r} is neither a file, a Jinja template nor a "
                         f"shipped one ({', '.join(shipped_templates())})")
    return check_chat_template(value, "--chat-template")


@functools.lru_cache(maxsize=16)
def _compile_chat_template(template: str):
    """Compile with transformers' environment: sandboxed, trim/lstrip blocks, loop controls, a
    tojson that keeps non-ASCII, raise_exception, strftime_now, and guarded dict/namespace."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class TemplateDict:  # `dict` without attribute access to the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # refuses underscore-prefixed names
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is refused")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, dict=TemplateDict(),
                       namespace=TemplateNamespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat_template does not compile: {e}") from e


def render_chat_template(template: str | None, messages: Sequence[dict],
                         add_generation_prompt: bool, **variables) -> str:
    """Validate `messages` and render `template` with them; `variables` (bos_token, eos_token,
    tools, ...) are passed to the template as they are."""
    if template is None:
        raise ValueError(NO_CHAT_TEMPLATE)
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                got = type(message[field]).__name__ if field in message else "nothing"
                raise ValueError(f"messages[{i}][{field!r}] must be a str, got {got}")
    import jinja2
    compiled = _compile_chat_template(template)
    try:
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               **{**NO_TEMPLATE_VARS, **variables})
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e


def _read_json(path: str) -> dict | None:
    """The JSON object in `path` (models.loading.user_files' rules), or None when the file does
    not exist."""
    from pagedjax.models.loading.user_files import read_user_json

    if not os.path.lexists(path):
        return None
    return read_user_json(path)


def _read_text(path: str, what: str) -> str:
    """A user-named chat template file (models.loading.user_files' rules)."""
    from pagedjax.models.loading.user_files import read_user_text

    return read_user_text(path, what, MAX_TEMPLATE_BYTES)


def _token_content(config: dict, field: str) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    value = config.get(field)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"tokenizer_config.json {field} must be a string or a dict with a "
                         f"string 'content', got {config.get(field)!r}")
    return value


def _chat_template_from_config(value: Any) -> str | None:
    """tokenizer_config.json chat_template: a string, or a list of {"name", "template"} of
    which "default" is used."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError(f"tokenizer_config.json chat_template must be a string or a list, "
                         f"got {type(value).__name__}")
    templates = {}
    for i, entry in enumerate(value):
        if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)):
            raise ValueError(f"tokenizer_config.json chat_template[{i}] must be a dict with "
                             f"string 'name' and 'template', got {entry!r}")
        templates[entry["name"]] = entry["template"]
    if "default" not in templates:
        raise ValueError(f"tokenizer_config.json chat_template has no template named 'default' "
                         f"(names: {sorted(templates)})")
    return templates["default"]


def _int_ids(value: Any, field: str) -> list[int]:
    """generation_config.json token ids: absent, an int or a list of ints."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"generation_config.json {field} must be an int >= 0 or a list of them, "
                         f"got {value!r}")
    return values


class Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer` with the model's special tokens and chat template."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 bos_token_id: int | None = None, eos_token_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))  # de-duplicated, order kept

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json (required), and tokenizer_config.json, chat_template.jinja (which
        wins over the config's template) and generation_config.json when present."""
        import tokenizers
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"{file} not found: a model directory needs a tokenizer.json")
        from pagedjax.models.loading.user_files import checked_path

        checked_path(file, "tokenizer.json", root=path)
        try:
            tokenizer = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # the Rust side raises plain Exception
            raise ValueError(f"{file} could not be loaded: {e}") from e
        config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        generation = _read_json(os.path.join(path, "generation_config.json")) or {}
        chat_template = _chat_template_from_config(config.get("chat_template"))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.lexists(jinja_file):
            chat_template = _read_text(jinja_file, "chat_template.jinja")
        bos_token = _token_content(config, "bos_token")
        eos_token = _token_content(config, "eos_token")
        bos_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
        eos_id = None if eos_token is None else tokenizer.token_to_id(eos_token)
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        if tokenizer.post_processor is None and (add_bos or add_eos):  # else tokenizer.json rules,
            # as in transformers 5 (which ignores the flags when there is a tokenizer.json)
            bos = [(bos_token, bos_id)] if add_bos and bos_id is not None else []
            eos = [(eos_token, eos_id)] if add_eos and eos_id is not None else []
            tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
                single=" ".join([f"{t}:0" for t, _ in bos] + ["$A:0"] + [f"{t}:0" for t, _ in eos]),
                special_tokens=bos + eos)
        generation_bos = _int_ids(generation.get("bos_token_id"), "bos_token_id")
        return cls(tokenizer, chat_template=chat_template, bos_token=bos_token, eos_token=eos_token,
                   bos_token_id=bos_id if bos_id is not None else next(iter(generation_bos), None),
                   eos_token_ids=_int_ids(generation.get("eos_token_id"), "eos_token_id")
                   + ([] if eos_id is None else [eos_id]))

    def save_pretrained(self, path: str | os.PathLike) -> str:
        """Write a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with
        the special tokens and chat template, generation_config.json with the EOS ids) that
        from_dir and transformers' AutoTokenizer load: a GGUF's tokenizer for tools that want
        one by path (benchmark clients counting tokens). Returns the directory."""
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        self._tokenizer.save(os.path.join(path, "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": self.bos_token,
                  "eos_token": self.eos_token, "chat_template": self.chat_template,
                  "clean_up_tokenization_spaces": False}
        generation = {"bos_token_id": self.bos_token_id, "eos_token_id": list(self.eos_token_ids)}
        for name, content in (("tokenizer_config.json", config),
                              ("generation_config.json", generation)):
            with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                json.dump({k: v for k, v in content.items() if v is not None}, f, indent=1)
        return path

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """(ids, segment of each: type ids) of two texts through the tokenizer's pair
        template (its post-processor's special tokens around and between them)."""
        encoding = self._tokenizer.encode(first, second, add_special_tokens=True)
        return encoding.ids, encoding.type_ids

    def to_json(self) -> str:
        """The tokenizer.json text (what grammar libraries build their token tables from)."""
        return self._tokenizer.to_str()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Token strings; None for an id outside the vocabulary."""
        return [self._tokenizer.id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, chat_template: str | None = None,
                            **extra) -> str | list[int]:
        """The rendered conversation, or its token ids when tokenize (encoded without special
        tokens: the template writes the BOS text itself); chat_template overrides the
        tokenizer's own (as transformers)."""
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                    if v is not None}
        text = render_chat_template(chat_template or self.chat_template, messages,
                                    add_generation_prompt, **{**specials, **extra})
        return self.encode(text, add_special_tokens=False) if tokenize else text


class ByteTokenizer:
    """The embedded model's vocabulary: ids 0..255 are bytes, 256 is <bos>, 257 is <eos>, and
    258..263 are reserved specials (<reserved_258>..). Special-token text in `encode` input
    becomes the special id, as added tokens do in Hugging Face tokenizers."""

    vocab_size = 264
    bos_token, eos_token = "<bos>", "<eos>"
    bos_token_id = 256
    eos_token_ids = (257,)
    chat_template = None  # it was trained on no conversations: chat needs one passed in
    SPECIALS = {256: "<bos>", 257: "<eos>", **{i: f"<reserved_{i}>" for i in range(258, 264)}}

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes (a special's its name), for grammar libraries' token tables."""
        return [bytes([i]) for i in range(256)] + [self.SPECIALS[i].encode()
                                                   for i in range(256, self.vocab_size)]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.bos_token_id] if add_special_tokens else []
        for i, piece in enumerate(_SPECIALS_RE.split(text)):  # odd pieces are special tokens
            ids.extend([_SPECIAL_IDS[piece]] if i % 2 else piece.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        parts, pending = [], bytearray()
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary "
                                 f"(vocab_size {self.vocab_size})")
            if i < 256:
                pending.append(i)
            elif not skip_special_tokens:  # skipped specials do not split the bytes around them
                parts += [pending.decode("utf-8", errors="replace"), self.SPECIALS[i]]
                pending = bytearray()
        return "".join(parts) + pending.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Printable ASCII as itself, other bytes as <0xNN> (SentencePiece style), specials by name;
        None outside the vocabulary."""
        return [chr(i) if 32 <= i < 127 else f"<0x{i:02X}>" if 0 <= i < 256
                else self.SPECIALS.get(i) for i in ids]

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, chat_template: str | None = None,
                            **extra) -> str | list[int]:
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        text = render_chat_template(chat_template or self.chat_template, messages,
                                    add_generation_prompt, **{**specials, **extra})
        return self.encode(text, add_special_tokens=False) if tokenize else text


_SPECIAL_IDS = {s: i for i, s in ByteTokenizer.SPECIALS.items()}
_SPECIALS_RE = re.compile("(" + "|".join(map(re.escape, _SPECIAL_IDS)) + ")")
