"""The gated delta rule's references (pallas_kernels/gated_delta.py) against transformers'
pure-torch ones (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule,
causal_conv1d_fn / _update in models/qwen3_next), and the chunked form against the recurrent one
token by token: grouped value heads (Hv = 2 Hk), a given initial state, lengths that are not
whole chunks, and one prefill split in pieces continuing from the state each piece leaves.
f32 throughout: 1e-5 relative is a few ulps of the sums over Dk and the chunk."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax.pallas_kernels.gated_delta import (causal_conv1d, chunked_gated_delta,
                                                 recurrent_gated_delta)

torch = pytest.importorskip("torch")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

TOL = dict(rtol=1e-5, atol=1e-5)


def inputs(seed: int, batch=2, length=13, hk=2, hv=4, dk=8, dv=6):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, length, hk, dk)).astype(np.float32)
    k = rng.normal(size=(batch, length, hk, dk)).astype(np.float32)
    v = rng.normal(size=(batch, length, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.5, size=(batch, length, hv)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, size=(batch, length, hv)).astype(np.float32)
    state = rng.normal(size=(batch, hv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


def torch_rule(fn, q, k, v, g, beta, state, **kw):
    out, final = fn(*(torch.from_numpy(x) for x in (q, k, v, g, beta)),
                    initial_state=torch.from_numpy(state), output_final_state=True,
                    use_qk_l2norm_in_kernel=True, **kw)
    return out.numpy(), final.numpy()


@pytest.mark.parametrize("length", [1, 5, 13])
def test_recurrent_rule_equals_transformers(length):
    args = inputs(0, length=length)
    out, state = recurrent_gated_delta(*args)
    ref_out, ref_state = torch_rule(qwen3_next.torch_recurrent_gated_delta_rule, *args)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(state, ref_state, **TOL)


@pytest.mark.parametrize("length,chunk", [(13, 4), (16, 8), (3, 64)])
def test_chunked_rule_equals_transformers_and_the_recurrent_rule(length, chunk):
    args = inputs(1, length=length)
    out, state = chunked_gated_delta(*args, chunk_size=chunk)
    ref_out, ref_state = torch_rule(qwen3_next.torch_chunk_gated_delta_rule, *args,
                                    chunk_size=chunk)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(state, ref_state, **TOL)
    rec_out, rec_state = recurrent_gated_delta(*args)  # token by token
    np.testing.assert_allclose(out, rec_out, **TOL)
    np.testing.assert_allclose(state, rec_state, **TOL)


def test_a_prefill_in_pieces_continues_from_each_pieces_state():
    q, k, v, g, beta, _ = inputs(2, length=17)
    whole, whole_state = chunked_gated_delta(q, k, v, g, beta, chunk_size=4)
    state, outs = None, []
    for start, stop in ((0, 6), (6, 7), (7, 17)):  # a chunk, one decode token, the rest
        piece = [x[:, start:stop] for x in (q, k, v, g, beta)]
        rule = recurrent_gated_delta if stop - start == 1 else chunked_gated_delta
        out, state = rule(*piece, initial_state=state)
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole, **TOL)
    np.testing.assert_allclose(state, whole_state, **TOL)


def test_causal_conv1d_equals_transformers_whole_and_step_by_step():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 9, 10)).astype(np.float32)  # [B, L, X]
    weight = rng.normal(size=(10, 4)).astype(np.float32)
    out, window = causal_conv1d(x, weight)
    ref = qwen3_next.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2),
                                      torch.from_numpy(weight), None, activation="silu")
    np.testing.assert_allclose(out, ref.transpose(1, 2).numpy(), **TOL)
    np.testing.assert_allclose(window, x[:, -3:])
    # the first 6 inputs whole, then one by one through transformers' update
    out6, window = causal_conv1d(x[:, :6], weight)
    conv_state = torch.from_numpy(np.ascontiguousarray(
        np.pad(x[:, :6], [(0, 0), (1, 0), (0, 0)])[:, -4:].transpose(0, 2, 1)))
    for t in range(6, 9):
        mine, window = causal_conv1d(x[:, t:t + 1], weight, window)
        theirs = qwen3_next.causal_conv1d_update(
            torch.from_numpy(x[:, t:t + 1]).transpose(1, 2), conv_state,
            torch.from_numpy(weight), None, "silu")
        np.testing.assert_allclose(mine, theirs.transpose(1, 2).numpy(), **TOL)
        np.testing.assert_allclose(mine, out[:, t:t + 1], **TOL)
