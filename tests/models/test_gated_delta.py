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


@pytest.mark.parametrize("length", [1, 13])
def test_recurrent_rule_equals_transformers(length):
    args = inputs(0, length=length)
    out, state = recurrent_gated_delta(*args)
    ref_out, ref_state = torch_rule(qwen3_next.torch_recurrent_gated_delta_rule, *args)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(state, ref_state, **TOL)


@pytest.mark.parametrize("length,chunk", [(13, 4), (16, 8), (3, 64)])
@pytest.mark.quick_variant('13-4')  # the others: make test-slow
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


@pytest.mark.slow  # the engine's chunked prefill checks it end to end in make test
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


@pytest.mark.parametrize("chunk_size", [64, pytest.param(2, marks=pytest.mark.slow)])
# (chunks of 2: make test-slow; the engine's 4-token chunks run rows of several in make test)
def test_a_ragged_step_equals_each_row_from_its_own_state(chunk_size):
    """Rows of 5, 0 (a fork follower), 1 (a decode) and 3 tokens back to back, then padding:
    each row's output and new state (recurrent matrix and conv window) equal the recurrent
    rule's from that row's state alone, in one chunk a row or in chunks of 2 (rows of several
    chunks, a partial last one); the empty row keeps its state."""
    import jax
    import jax.numpy as jnp

    from pagedjax.pallas_kernels.gated_delta import ragged_causal_conv1d, ragged_gated_delta
    q_lens = [5, 0, 1, 3]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    total, padded = int(cu[-1]), 12
    q, k, v, g, beta, _ = inputs(4, batch=1, length=padded)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))
    states = np.random.default_rng(5).normal(size=(4, 4, 8, 6)).astype(np.float32)
    out, new = jax.jit(ragged_gated_delta, static_argnames=("chunk_size",))(
        q, k, v, g, beta, jnp.asarray(states), jnp.asarray(cu), jnp.asarray(total),
        chunk_size=chunk_size)
    np.testing.assert_array_equal(out[total:], 0.0)  # padding reads nothing
    rng = np.random.default_rng(6)
    x = rng.normal(size=(padded, 10)).astype(np.float32)
    weight = rng.normal(size=(10, 4)).astype(np.float32)
    windows = rng.normal(size=(4, 3, 10)).astype(np.float32)
    conv, new_windows = jax.jit(ragged_causal_conv1d)(jnp.asarray(x), jnp.asarray(weight),
                                                      jnp.asarray(windows), jnp.asarray(cu))
    for row, (start, stop) in enumerate(zip(cu[:-1], cu[1:])):
        if start == stop:
            np.testing.assert_array_equal(new[row], states[row])
            np.testing.assert_array_equal(new_windows[row], windows[row])
            continue
        piece = [t[None, start:stop] for t in (q, k, v, g, beta)]
        ref_out, ref_state = recurrent_gated_delta(*piece, initial_state=states[row:row + 1])
        np.testing.assert_allclose(out[start:stop], ref_out[0], **TOL)
        np.testing.assert_allclose(new[row], ref_state[0], **TOL)
        ref_conv, ref_window = causal_conv1d(x[None, start:stop], weight, windows[row:row + 1])
        np.testing.assert_allclose(conv[start:stop], ref_conv[0], **TOL)
        np.testing.assert_allclose(new_windows[row], ref_window[0], **TOL)
    decode = ragged_gated_delta(q[:4], k[:4], v[:4], g[:4], beta[:4], jnp.asarray(states),
                                jnp.arange(5, dtype=jnp.int32), jnp.asarray(4),
                                decode_only=True)
    for row in range(4):  # one token a row, every row at once
        ref_out, ref_state = recurrent_gated_delta(
            *(t[None, row:row + 1] for t in (q, k, v, g, beta)),
            initial_state=states[row:row + 1])
        np.testing.assert_allclose(decode[0][row], ref_out[0, 0], **TOL)
        np.testing.assert_allclose(decode[1][row], ref_state[0], **TOL)


def test_states_round_trip_through_their_pages_and_padding_writes_the_null_block():
    import jax.numpy as jnp

    from pagedjax.pallas_kernels.state_pages import (page_values, read_states, state_blocks,
                                                     write_states)
    cache = jnp.asarray(np.random.default_rng(7).normal(size=(2, 2, 12, 4, 8)), jnp.float32)
    size = 300  # over 2 pages of 128 values: 3 blocks
    n = state_blocks(size, page_values(cache))
    assert n == 3
    tables = jnp.asarray([[5, 2, 9], [0, 0, 0]], jnp.int32)  # a row, then a padding row
    states = np.random.default_rng(8).normal(size=(2, size)).astype(np.float32)
    written = write_states(cache, tables, jnp.asarray(states))
    np.testing.assert_array_equal(read_states(written, tables[:1], size), states[:1])
    untouched = [b for b in range(12) if b not in (0, 5, 2, 9)]
    np.testing.assert_array_equal(written[:, :, untouched], cache[:, :, untouched])
