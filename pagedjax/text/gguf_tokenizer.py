"""The tokenizer a GGUF file embeds, rebuilt with the `tokenizers` library.

A `gpt2`-model vocabulary (byte-level BPE: every token already spelled in GPT-2's byte
alphabet) with its merges; the text split before BPE as llama.cpp splits it for the file's
`tokenizer.ggml.pre` (the pre-tokenizer the vocabulary was trained with); control tokens
(token type 3) special, user-defined ones (4) added whole; BOS prepended when the file says
`add_bos_token`; the chat template from `tokenizer.chat_template`. SentencePiece (`llama`)
vocabularies are refused by name.
"""

from __future__ import annotations

from pagedjax.text.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4
# Text splits of llama.cpp's pre-tokenizers (llama-vocab.cpp), as tokenizers' pre-tokenizers.
_GPT2 = "gpt2"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_SPLITS = {"smollm": "digits", "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT,
              "llama-v3": _LLAMA3_SPLIT, "default": _GPT2, "gpt-2": _GPT2, "gpt2": _GPT2}


def _pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    split = PRE_SPLITS.get(pre or "default")
    if split is None:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (known: "
                         f"{sorted(PRE_SPLITS)})")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's
    if split == _GPT2:
        return byte_level
    if split == "digits":  # SmolLM: every digit its own piece, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(meta: dict, path: str = "") -> Tokenizer:
    """The Tokenizer of a GGUF file's metadata (pagedjax.models.loading.gguf.metadata)."""
    import tokenizers
    from tokenizers import AddedToken, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (byte-level "
                         f"BPE, 'gpt2', is); give the HF tokenizer directory with --tokenizer")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])

    def token(field):
        index = meta.get(f"tokenizer.ggml.{field}")
        return (None, None) if index is None or index >= len(tokens) else (tokens[index], index)

    bos, bos_id = token("bos_token_id")
    eos, eos_id = token("eos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", special_tokens=[(bos, bos_id)])
    return Tokenizer(tokenizer, chat_template=meta.get("tokenizer.chat_template"),
                     bos_token=bos, eos_token=eos, bos_token_id=bos_id,
                     eos_token_ids=[] if eos_id is None else [eos_id])
