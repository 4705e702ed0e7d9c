"""`make demo`'s output, checked: the chat demo (here on a small GGUF written by tests/models/test_gguf.py,
random weights, so the suite stays fast; `make demo` runs SmolLM2-135M-Instruct) answers every
question, hits the prefix cache and preempts; the tiny model's demo grades only what it can do,
and gets it all right."""

from __future__ import annotations

import re

import pytest

from pagedjax.models import DEFAULT_CHECKPOINT
from pagedjax.tools import demo


def table_value(out: str, key: str) -> str:
    match = re.search(rf"^  {re.escape(key)}\s+(.*)$", out, re.M)
    assert match, (key, out[-2000:])
    return match.group(1)


@pytest.mark.slow  # make test-slow
def test_chat_demo_answers_hits_the_prefix_cache_and_preempts(tmp_path, capsys):
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from test_gguf import write_gguf

    path, _, _ = write_gguf(tmp_path)
    demo.main(["--model", path, "--burst", "12", "--max-tokens", "24", "--num-blocks", "20",
               "--max-num-seqs", "8"])
    out = capsys.readouterr().out
    answers = re.findall(r"^  A\d*: (.*)$", out, re.M)
    assert len(answers) == 6 + 3 + 3 and all(a.strip() for a in answers), out
    assert int(table_value(out, "preemptions").split()[0]) > 0
    assert int(table_value(out, "prefix cache hits").split()[0]) > 0
    assert table_value(out, "requests (samples)") == "19 (21)"


def test_tiny_model_demo_grades_only_what_it_can_do(capsys):
    demo.main(["--model", DEFAULT_CHECKPOINT])
    out = capsys.readouterr().out
    accuracy = re.search(r"^accuracy \(exact match\):\s+(.*)$", out, re.M).group(1)
    scores = re.findall(r"(\S+(?: n=\d+)?) (\d+)/(\d+)", accuracy)
    assert scores and all(got == total for _, got, total in scores), accuracy
    assert "recall" not in out
    assert int(table_value(out, "preemptions").split()[0]) > 0
