"""llama.cpp's own tokenization of hard strings, the reference a GGUF's tokenizer is held to
(tests/test_gguf_tokenizer.py): run with llama-cpp-python (its own venv: `make
gguf-tokenizer-reference`), it writes each string's ids, as llama.cpp tokenizes them with special
tokens parsed and no BOS added, and its decoding of those ids (special tokens spelled out),
beside the file's name and size. No pagedjax import: the
reference is llama.cpp's alone.

    .venv-llamacpp/bin/python tests/references/llama_cpp_tokens.py MODEL.gguf OUT.json
"""

from __future__ import annotations

import json
import os
import sys

# Whitespace runs, tabs and newlines, digits (ASCII and others), unicode (accents, CJK,
# Cyrillic, emoji with modifiers and joiners, ligatures, combining marks, zero-width and
# no-break spaces), control characters, contractions, special tokens (whole, repeated,
# partial, glued to text), and long runs.
CORPUS = [
    "  12+7 = 19", " 12", "12", "a  b", "   leading", "trailing   ", "mid   dle", " ",
    "  ", "   ", " " * 17, "\t", "\t\ttabs", "x \t y", "a\tb\t\tc", "\n", "a\n\nb", "\n" * 5,
    "\r\n", "line\r\nnext", " \n ", "  \n\n  x", "    def f():\n        return 1\n",
    "12345", "3.14159", "1,000,000", "x=3.14", "2026-12-05", "０１２", "٣٤٥", "①②③",
    "v1.2.3-rc4", "0x1F", "1e-10",
    "café", "naïve résumé", "東京タワー", "Привет мир", "Ελληνικά", "עברית", "हिन्दी",
    "😀🙂👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "ﬁ ﬂ", "e\u0301", "zero\u200bwidth",
    "no\u00a0break", "\x00", "\x01\x02\x7f", "tab\x0bvt",
    "don't", "I'M", "we'LL", "GPU's", "it's 'quoted'", "''", "\"double\"",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|><|im_start|>", "<|im_start", "im_start|>", "x<|im_end|>y", " <|im_end|> ",
    "a" * 50, "ab" * 30, "!!!???...", "--->", "#include <stdio.h>", "{\"k\": [1, 2]}",
    "https://example.com/a?b=c&d=e", "C:\\path\\to", "$x_{i}^{2}$", "	mixed \t\n whitespace  ",
]

PIECES = ["Hello", " world", "\n", "  ", "\t", "café", "東京", "🙂", "12345", "x=3.14",
          "<|im_start|>", "<|im_end|>", "<|endoftext|>", "don't", "GPU's", " ", "ﬁ", " 7",
          "\r\n", "   ", "٣", "\u00a0"]


def mixtures(count: int = 200, seed: int = 0) -> list[str]:
    """Strings of 1 to 8 random pieces (the joins are where splitters disagree)."""
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))) for _ in range(count)]


def main(argv: list[str]) -> int:
    from llama_cpp import Llama

    model_path, out_path = argv
    llm = Llama(model_path=model_path, vocab_only=True, verbose=False)
    import llama_cpp

    cases = []
    for text in CORPUS + mixtures():
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        back = llm.detokenize(ids, special=True).decode("utf-8", errors="replace")
        cases.append({"text": text, "ids": ids, "decoded": back})
    head = {"gguf": os.path.basename(model_path), "bytes": os.path.getsize(model_path),
            "llama_cpp_python": llama_cpp.__version__}
    with open(out_path, "w", encoding="utf-8") as f:  # a case a line
        f.write(json.dumps(head)[:-1] + ', "cases": [\n')
        f.write(",\n".join(json.dumps(case) for case in cases) + "\n]}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
