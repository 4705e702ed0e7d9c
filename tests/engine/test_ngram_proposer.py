"""The n-gram proposer (pagedjax/engine/spec_decode/ngram_proposer.py) against a plain-Python reading of its rule
on random token lists over small vocabularies (many repeats), and on worked examples."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.engine.spec_decode.ngram_proposer import NgramProposer


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix of n in [lo, hi] tokens seen earlier (with a token after it), the k
    tokens after its most recent such occurrence (continuing into its own drafts past the
    end)."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                drafts = tokens[start + n:start + n + k]
                while len(drafts) < k:  # past the end: what it predicts, periodically
                    drafts.append(drafts[len(drafts) - (len(tokens) - start - n)])
                return drafts
    return []


def test_worked_examples():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # "a b c d ... a b c" -> the continuation of the earlier "a b c": d, e, f
    assert proposer.propose([1, 2, 3, 4, 5, 6, 9, 1, 2, 3]).tolist() == [4, 5, 6]
    # two earlier occurrences: the most recent one's continuation
    assert proposer.propose([7, 1, 8, 7, 1, 9, 7, 1]).tolist() == [9, 7, 1]
    # the longest suffix wins: "0 6" was followed by 4; the more recent "6" alone, by 5
    assert proposer.propose([9, 0, 6, 4, 6, 5, 0, 6]).tolist() == [4, 6, 5]
    assert proposer.propose([1, 2, 3]).tolist() == []  # nothing repeats
    assert proposer.propose([4, 4]).tolist() == [4, 4, 4]  # a run goes on
    assert proposer.propose([5, 1, 2, 1, 2]).tolist() == [1, 2, 1]  # with its period
    assert proposer.propose([1, 2, 1, 2], max_drafts=1).tolist() == [1]
    assert proposer.propose([1]).tolist() == []


@pytest.mark.parametrize("seed", range(4))
def test_equals_the_rule_on_random_tokens(seed):
    rng = np.random.default_rng(seed)
    for _ in range(300):
        vocab, length = int(rng.integers(2, 6)), int(rng.integers(1, 40))
        tokens = rng.integers(0, vocab, length).tolist()
        k, lo = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        got = NgramProposer(k, lo, hi).propose(tokens)
        assert got.dtype == np.int32
        assert got.tolist() == reference(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_invalid_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="prompt_lookup_min .3. must not exceed"):
        NgramProposer(2, prompt_lookup_min=3, prompt_lookup_max=2)


def test_a_prediction_is_matched_where_the_output_has_got_to():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3)
    prediction = [1, 2, 3, 4, 5, 1, 2, 6, 7]
    assert proposer.propose_in(prediction, []).tolist() == [1, 2, 3]  # from its start
    assert proposer.propose_in(prediction, [1, 2, 3]).tolist() == [4, 5, 1]
    # "1 2" twice: the occurrence nearest the output's length (7 tokens) wins
    assert proposer.propose_in(prediction, [9, 9, 9, 9, 9, 1, 2]).tolist() == [6, 7]
    assert proposer.propose_in(prediction, [1, 2]).tolist() == [3, 4, 5]
    # an edit: the output's last token alone still anchors it (down to one token)
    assert proposer.propose_in(prediction, [1, 2, 3, 8, 4]).tolist() == [5, 1, 2]
    assert proposer.propose_in(prediction, [0, 8]).tolist() == []
    assert proposer.propose_in(prediction, [1], max_drafts=1).tolist() == [2]
