# Copyright 2026 the turbospark authors. Apache-2.0.
"""The gated delta rule: one compiled step for decoding, a chunked (WY) form for prefill.

Per value head, with state ``S`` ``[Dk, Dv]``, decay ``g_t <= 0`` (log space),
rate ``beta_t`` and L2-normalized ``q_t`` (scaled by ``Dk**-0.5``) and ``k_t``::

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - k_t^T exp(g_t) S_{t-1}))^T
    o_t = S_t^T q_t

The chunked form processes a chunk of tokens with matrix products: inside a
chunk the corrections ``u`` solve a unit lower-triangular system
``(I + A) u = beta v - (beta exp(gamma) k)^T S_0``, and only the state is
carried from chunk to chunk. Every operation is lazy: a prefill chunk is one
graph, evaluated once by the caller.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

# CPU (OpenBLAS): 16/32/64 within noise of each other, 128 several times slower; 32 keeps
# chunked-vs-stepped logits closest. GPU: the usual 64.
CPU_CHUNK = 32
GPU_CHUNK = 64
L2_EPS = 1e-6


def l2_normalize(x: mx.array) -> mx.array:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis (the reference's l2norm)."""
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + L2_EPS)


@mx.compile
def _step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    # q, k [B, H, Dk]; v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv]
    state = state * mx.exp(g)[..., None, None]
    kv = (state * k[..., None]).sum(axis=-2)
    delta = (v - kv) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(axis=-2), state


def recurrent(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """Token by token (``[B, H, L, D]`` layout); one compiled step per token (the chunked form's reference)."""
    outs = []
    for t in range(q.shape[2]):
        y, state = _step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state)
        outs.append(y)
    return mx.stack(outs, axis=2), state


def unit_lower_inverse(a: mx.array) -> mx.array:
    """``(I + a)^-1`` for strictly lower-triangular ``a`` ``[..., C, C]``.

    On the CPU, LAPACK's triangular inverse; elsewhere the Neumann product
    ``(I - a)(I + a^2)(I + a^4)...``, which is exact for a nilpotent ``a`` and
    needs only matrix products.
    """
    C = a.shape[-1]
    eye = mx.eye(C, dtype=a.dtype)
    if mx.default_device() == mx.cpu:
        return mx.linalg.tri_inv(eye + a, upper=False, stream=mx.cpu)
    return _neumann_inverse(a)


def _neumann_inverse(a: mx.array) -> mx.array:
    C = a.shape[-1]
    eye = mx.eye(C, dtype=a.dtype)
    power = -a
    out = eye + power
    span = 2
    while span < C:
        power = power @ power
        out = out @ (eye + power)
        span *= 2
    return out


def _pad_to_chunks(arrays: list[mx.array], L: int, C: int) -> list[mx.array]:
    # Padding with k = v = q = beta = g = 0 leaves the state untouched
    pad = (-L) % C
    if not pad:
        return arrays
    return [mx.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3)) for x in arrays]


def chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk: int | None = None,
    inverse: Callable[[mx.array], mx.array] = unit_lower_inverse,
) -> tuple[mx.array, mx.array]:
    """The whole sequence in chunks of ``chunk`` tokens (``[B, H, L, D]`` layout, float32).

    Only the state crosses chunk boundaries: the loop over chunks builds one
    lazy graph, two small matrix products per chunk.
    """
    B, H, L, _ = q.shape
    Dv = v.shape[-1]
    chunk = chunk or (CPU_CHUNK if mx.default_device() == mx.cpu else GPU_CHUNK)
    C = min(chunk, L)
    q, k, v, g, beta = _pad_to_chunks([q, k, v, g, beta], L, C)
    N = q.shape[2] // C
    q, k, v = (x.reshape(B, H, N, C, -1) for x in (q, k, v))
    g, beta = (x.reshape(B, H, N, C) for x in (g, beta))

    gamma = mx.cumsum(g, axis=-1)  # log decay from the chunk start
    causal = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    decay = mx.exp(mx.where(causal, gamma[..., :, None] - gamma[..., None, :], -mx.inf))
    k_beta = k * beta[..., None]
    k_t = k.swapaxes(-1, -2)
    a = mx.where(mx.tril(causal, -1), (k_beta @ k_t) * decay, 0.0)
    t_inv = inverse(a)
    u = t_inv @ (v * beta[..., None])  # corrections, before the carried state's part
    w = t_inv @ (k_beta * mx.exp(gamma)[..., None])  # how the carried state enters them
    attn = (q @ k_t) * decay
    q_state = q * mx.exp(gamma)[..., None] - attn @ w  # outputs = q_state @ S0 + attn @ u
    attn_u = attn @ u
    last = gamma[..., -1:]
    k_end = (k * mx.exp(last - gamma)[..., None]).swapaxes(-1, -2)
    chunk_decay = mx.exp(last)[..., None]

    starts = []
    for n in range(N):
        starts.append(state)
        v_new = u[:, :, n] - w[:, :, n] @ state
        state = state * chunk_decay[:, :, n] + k_end[:, :, n] @ v_new
    out = q_state @ mx.stack(starts, axis=2) + attn_u
    return out.reshape(B, H, N * C, Dv)[:, :, :L], state


def gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array,
) -> tuple[mx.array, mx.array]:
    """Run the gated delta rule over a chunk of tokens.

    Args:
        q: Queries ``[B, L, Hk, Dk]``, L2-normalized and scaled by ``Dk**-0.5``.
        k: Keys ``[B, L, Hk, Dk]``, L2-normalized.
        v: Values ``[B, L, Hv, Dv]``; each key head serves ``Hv // Hk`` consecutive value heads.
        g: Log decay ``[B, L, Hv]`` (``<= 0``).
        beta: Write strength ``[B, L, Hv]`` in ``(0, 1)``.
        state: The carried state ``[B, Hv, Dk, Dv]``.

    Returns:
        Outputs ``[B, L, Hv, Dv]`` and the new state, both float32.
    """
    repeat = v.shape[2] // q.shape[2]
    if repeat > 1:
        q, k = mx.repeat(q, repeat, axis=2), mx.repeat(k, repeat, axis=2)
    state = state.astype(mx.float32)
    if q.shape[1] == 1:  # one token (a decode step): the compiled step on its rows, without transposes
        q, k, v, g, beta = (x.squeeze(1).astype(mx.float32) for x in (q, k, v, g, beta))
        out, state = _step(q, k, v, g, beta, state)
        return out[:, None], state
    q, k, v, g, beta = (x.swapaxes(1, 2).astype(mx.float32) for x in (q, k, v, g, beta))
    out, state = chunked(q, k, v, g, beta, state)
    return out.swapaxes(1, 2), state
