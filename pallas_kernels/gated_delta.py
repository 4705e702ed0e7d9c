"""The gated delta rule (Gated DeltaNet's linear attention: Qwen3.5, Qwen3-Next) and the causal
depthwise conv1d before it, in pure jnp: the references the serving path and any kernel are
checked against.

Per value head, with a state S [Dk, Dv] and each token's q, k [Dk], v [Dv], decay g <= 0 (log
space) and write strength beta in (0, 1):

    S <- exp(g) * S                    (forget)
    S <- S + k (beta * (v - S^T k))^T   (the delta rule: write what S does not yet predict)
    o  = S^T q

q and k are L2-normalised (FLA's eps 1e-6) and q scaled by Dk ** -0.5, as transformers' and
flash-linear-attention's kernels do; every product in f32. Two forms: `recurrent_gated_delta`
(token by token: decode) and `chunked_gated_delta` (chunks of C tokens: the within-chunk part
as matmuls through a unit lower-triangular solve, the state carried from chunk to chunk:
prefill). Both start from a given state and return the state they leave, so a prefill split into
chunks continues exactly where the last one stopped.

Axis letters: B sequences, L tokens, Hk key heads, Hv value heads (a multiple of Hk: each
q/k head serves Hv / Hk consecutive value heads), Dk key dim, Dv value dim, C chunk, K conv
kernel, X conv channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6


def l2_normalize(x: jax.Array) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in f32 (flash-linear-attention's l2norm)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _prepare(q, k, v, g, beta):
    """f32 inputs with q and k normalised, q scaled, and q/k repeated to the value heads."""
    repeats = v.shape[-2] // k.shape[-2]
    q, k = (jnp.repeat(l2_normalize(x), repeats, axis=-2) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32)


def delta_step(state: jax.Array, q, k, v, g, beta) -> tuple[jax.Array, jax.Array]:
    """One token's update of prepared inputs (q, k [..., Hv, Dk], v [..., Hv, Dv], g, beta
    [..., Hv]) on state f32[..., Hv, Dk, Dv]: (output [..., Hv, Dv], new state)."""
    state = state * jnp.exp(g)[..., None, None]
    predicted = jnp.einsum("...kv,...k->...v", state, k)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("...kv,...k->...v", state, q), state


def recurrent_gated_delta(q, k, v, g, beta, initial_state=None):
    """Token by token. q, k [B, L, Hk, Dk], v [B, L, Hv, Dv], g, beta [B, L, Hv],
    initial_state f32[B, Hv, Dk, Dv] (None: zeros) -> (out f32[B, L, Hv, Dv], final state)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, _, heads, dk = k.shape
    state = (jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))

    def body(state, xs):
        out, state = delta_step(state, *xs)
        return state, out

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out = jax.lax.scan(body, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def chunked_gated_delta(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
    """recurrent_gated_delta's result in chunks of chunk_size tokens (the WY / UT form of
    transformers' torch_chunk_gated_delta_rule): within a chunk, the delta rule's L writes are
    one unit lower-triangular solve; from chunk to chunk, the state. Padding past L (to a whole
    chunk) has beta 0 and g 0: it writes nothing and decays nothing."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    pad = -length % chunk_size
    padded = [jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
              for x in (q, k, v, g, beta)]
    # [N, B, Hv, C, ...]: chunks, sequences, heads, then a chunk's tokens
    chunks = [jnp.moveaxis(x.reshape(batch, -1, chunk_size, *x.shape[2:]), (1, 3), (0, 2))
              for x in padded]
    state = (jnp.zeros((batch, heads, dk, dv), jnp.float32) if initial_state is None
             else initial_state.astype(jnp.float32))
    state, out = jax.lax.scan(chunk_step, state, within_chunks(*chunks))  # [N, B, Hv, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, -1, dv)[:, :, :length]
    return jnp.moveaxis(out, 1, 2), state


def within_chunks(q, k, v, g, beta) -> tuple:
    """What each chunk computes without the state (prepared inputs [..., Hv, C, D] and
    [..., Hv, C]): (u: its writes' targets, the keys that read the old state, decayed, the
    causal q.k within the chunk, the decayed queries, the keys decayed to the chunk's end, the
    chunk's whole decay)."""
    size = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)  # log decay from the chunk's start to each token
    causal = jnp.tril(jnp.ones((size, size), bool))
    pair = jnp.where(causal, jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :],
                                               0.0)), 0.0)  # decay from token j to token i
    k_beta = k * beta[..., None]
    system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * pair
    solve = jnp.vectorize(lambda a, b: jax.scipy.linalg.solve_triangular(
        a, b, lower=True, unit_diagonal=True), signature="(c,c),(c,d)->(c,d)")
    values = solve(system, v * beta[..., None])
    k_decayed = solve(system, k_beta * jnp.exp(cum)[..., None])
    within = jnp.einsum("...ik,...jk->...ij", q, k) * pair
    return (values, k_decayed, within, q * jnp.exp(cum)[..., None],
            k * jnp.exp(cum[..., -1:] - cum)[..., None], jnp.exp(cum[..., -1]))


def chunk_step(state: jax.Array, parts: tuple) -> tuple[jax.Array, jax.Array]:
    """One chunk from state f32[..., Hv, Dk, Dv] (within_chunks' parts of that chunk):
    (the state after it, its output [..., Hv, C, Dv])."""
    values, k_decayed, within, q_decayed, k_to_end, decay = parts
    new = values - jnp.einsum("...ck,...kv->...cv", k_decayed, state)
    out = (jnp.einsum("...ck,...kv->...cv", q_decayed, state)
           + jnp.einsum("...ij,...jv->...iv", within, new))
    state = state * decay[..., None, None] + jnp.einsum("...ck,...cv->...kv", k_to_end, new)
    return state, out


def causal_conv1d(x: jax.Array, weight: jax.Array, window: jax.Array | None = None,
                  activation=jax.nn.silu) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv over L: out[t, c] = act(sum_j weight[c, j] * x[t - K + 1 + j, c]),
    inputs before the first read from window (the previous K - 1 inputs; zeros when None).
    x [B, L, X], weight [X, K], window [B, K - 1, X] -> (out [B, L, X] in x's dtype, the last
    K - 1 inputs: the next call's window)."""
    batch, length, channels = x.shape
    taps = weight.shape[-1]
    if window is None:
        window = jnp.zeros((batch, taps - 1, channels), x.dtype)
    full = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, K - 1 + L, X]
    out = sum(full[:, j:j + length].astype(jnp.float32) * weight[:, j].astype(jnp.float32)
              for j in range(taps))
    return activation(out).astype(x.dtype), full[:, length:]


# ---- a step's ragged batch: sequences back to back, each from its own state ------------------

def token_rows(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(row i32[T]: each token's sequence, offset i32[T]: its index in the row's query) for
    T = num_tokens; padding tokens past the last row's get the last row and an offset past it."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, cu_q_lens.shape[0] - 2)
    return row.astype(jnp.int32), t - cu_q_lens[row]


def ragged_causal_conv1d(x: jax.Array, weight: jax.Array, windows: jax.Array,
                         cu_q_lens: jax.Array, activation=jax.nn.silu):
    """causal_conv1d over a step's rows: x [T, X] (rows back to back, cu_q_lens i32[B + 1]),
    windows [B, K - 1, X] each row's last inputs before this step -> (out [T, X], the rows'
    new windows [B, K - 1, X]; a row with no query tokens keeps its own)."""
    taps = weight.shape[-1]
    row, offset = token_rows(cu_q_lens, x.shape[0])
    t = jnp.arange(x.shape[0])
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(taps):  # tap j reads the input (taps - 1 - j) tokens back
        back = taps - 1 - j
        from_x = x[jnp.clip(t - back, 0, None)]
        from_window = windows[row, jnp.clip(offset - back + taps - 1, 0, taps - 2)]
        value = jnp.where((offset >= back)[:, None], from_x, from_window.astype(x.dtype))
        out = out + value.astype(jnp.float32) * weight[:, j].astype(jnp.float32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    m = jnp.arange(taps - 1)
    relative = q_lens[:, None] - (taps - 1) + m[None, :]  # [B, K - 1]: into this step's tokens
    from_x = x[jnp.clip(cu_q_lens[:-1, None] + relative, 0, x.shape[0] - 1)]
    from_window = jnp.take_along_axis(
        windows, jnp.clip(q_lens[:, None] + m[None, :], 0, taps - 2)[..., None], axis=1)
    new_windows = jnp.where((relative >= 0)[..., None], from_x.astype(windows.dtype),
                            from_window)
    return activation(out).astype(x.dtype), new_windows


def ragged_gated_delta(q, k, v, g, beta, states: jax.Array, cu_q_lens: jax.Array,
                       num_real: jax.Array, decode_only: bool = False, chunk_size: int = 64,
                       kernels=None):
    """The gated delta rule over a step's rows, each from its own state: q, k [T, Hk, Dk],
    v [T, Hv, Dv], g, beta [T, Hv], states f32[B, Hv, Dk, Dv] -> (out f32[T, Hv, Dv], the rows'
    new states). Tokens from num_real on are padding: they change no state and read zeros.
    decode_only (one token a row, T == B): every row's recurrent update at once. Otherwise the
    chunked form over chunks that never cross a row: each row's query in chunks of
    min(chunk_size, T) tokens (its last one partial), at most T / C + B of them a step, their
    within-chunk parts computed together, then one scan over the chunks carrying the rows'
    states. kernels (pallas_kernels/gated_delta_step.py's DeltaKernels): a platform's Pallas
    update and chunk scan in place of delta_step and the lax.scan (None: the jnp forms)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    update = getattr(kernels, "update", None) or delta_step
    if decode_only:
        return update(states, q, k, v, g, beta)
    size = min(chunk_size, q.shape[0])
    row, valid, index = _row_chunks(cu_q_lens, num_real, q.shape[0], states.shape[0], size)

    def chunked(x):  # [T, Hv, ...] -> [N, Hv, C, ...], zeros off the rows
        taken = jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[index], 0.0)
        return jnp.moveaxis(taken, 1, 2)

    parts = within_chunks(*(chunked(x) for x in (q, k, v, g, beta)))

    def body(states, xs):
        r, part = xs
        state, out = chunk_step(states[r], part)
        return states.at[r].set(state), out

    if getattr(kernels, "chunk_scan", None) is not None:
        out, states = kernels.chunk_scan(parts, row, states)
    else:
        states, out = jax.lax.scan(body, states, (row, parts))  # out [N, Hv, C, Dv]
    out = jnp.moveaxis(out, 1, 2)  # [N, C, Hv, Dv]
    target = jnp.where(valid, index, q.shape[0])  # off the rows: dropped
    tokens = jnp.zeros(v.shape, jnp.float32).at[target.reshape(-1)].set(
        out.reshape(-1, *out.shape[2:]), mode="drop")
    return tokens, states


def _row_chunks(cu_q_lens, num_real, num_tokens: int, num_rows: int, size: int):
    """The chunks of a step's rows (N = num_tokens // size + num_rows, a bound): each chunk's
    row i32[N] (empty chunks: the last row, all invalid), which of its size slots hold a token
    of the row (bool[N, C]) and those tokens' indices i32[N, C]."""
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    count = (q_lens + size - 1) // size
    ends = jnp.cumsum(count)
    n = num_tokens // size + num_rows
    c = jnp.arange(n, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(ends, c, side="right"), 0, num_rows - 1).astype(jnp.int32)
    first = (ends - count)[row]
    index = cu_q_lens[row][:, None] + (c - first)[:, None] * size + jnp.arange(size)[None]
    valid = ((c < ends[-1])[:, None] & (index < cu_q_lens[row + 1][:, None])
             & (index < num_real))
    return row, valid, jnp.where(valid, index, 0)
