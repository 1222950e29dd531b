"""The chunked gated delta rule equals the token-by-token recurrence."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from turbospark_qwen import gated_delta as gd


def _inputs(B: int, H: int, L: int, Dk: int, Dv: int, seed: int = 0) -> list[mx.array]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, L, Dk)).astype(np.float32)
    k = rng.standard_normal((B, H, L, Dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(Dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, H, L, Dv)).astype(np.float32)
    rate = np.exp(rng.uniform(np.log(0.01), np.log(16), (1, H, 1)))
    g = -rate * np.log1p(np.exp(rng.standard_normal((B, H, L))))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, H, L))))
    state = rng.standard_normal((B, H, Dk, Dv)) * 0.1
    return [mx.array(x.astype(np.float32)) for x in (q, k, v, g, beta, state)]


def _rel(got: mx.array, want: mx.array) -> float:
    return float(mx.abs(got - want).max() / mx.abs(want).max())


@pytest.mark.parametrize("L", [1, 7, 64, 150])
@pytest.mark.parametrize("inverse", [gd.unit_lower_inverse, gd._neumann_inverse], ids=["tri_inv", "neumann"])
def test_chunked_matches_recurrence(L: int, inverse) -> None:
    x = _inputs(2, 4, L, 16, 8)
    want_out, want_state = gd.recurrent(*x)
    out, state = gd.chunked(*x, inverse=inverse)
    assert out.shape == want_out.shape and state.shape == want_state.shape
    assert _rel(out, want_out) < 1e-5
    assert _rel(state, want_state) < 1e-5


def test_small_chunks_carry_state_across_many_chunks() -> None:
    x = _inputs(1, 2, 45, 8, 8, seed=3)
    want_out, want_state = gd.recurrent(*x)
    out, state = gd.chunked(*x, chunk=8)
    assert _rel(out, want_out) < 1e-5 and _rel(state, want_state) < 1e-5


def test_grouped_value_heads_share_consecutive_key_heads() -> None:
    q, k, v, g, beta, state = _inputs(1, 4, 5, 8, 8, seed=1)
    # two key heads, each serving two consecutive value heads
    qk = [x[:, ::2].swapaxes(1, 2) for x in (q, k)]
    out, _ = gd.gated_delta(*qk, v.swapaxes(1, 2), g.swapaxes(1, 2), beta.swapaxes(1, 2), state)
    rep = [mx.repeat(x[:, ::2], 2, axis=1) for x in (q, k)]
    want, _ = gd.recurrent(*rep, v, g, beta, state)
    assert _rel(out.swapaxes(1, 2), want) < 1e-5


def test_padding_leaves_the_state_untouched() -> None:
    x = _inputs(1, 2, 10, 8, 8, seed=2)
    _, exact = gd.chunked(*x, chunk=10)
    _, padded = gd.chunked(*x, chunk=16)  # 10 tokens padded to one chunk of 16
    assert _rel(padded, exact) < 1e-6


def test_one_token_takes_the_step_exactly() -> None:
    """A decode step (one token) runs the compiled step on its rows: bit for bit the recurrence's step."""
    q, k, v, g, beta, state = _inputs(2, 4, 1, 16, 8, seed=4)
    qk = [x[:, ::2].swapaxes(1, 2) for x in (q, k)]  # two key heads, each serving two value heads
    out, new_state = gd.gated_delta(*qk, v.swapaxes(1, 2), g.swapaxes(1, 2), beta.swapaxes(1, 2), state)
    rep = [mx.repeat(x[:, ::2], 2, axis=1) for x in (q, k)]
    want, want_state = gd.recurrent(*rep, v, g, beta, state)
    assert out.shape == (2, 1, 4, 8)
    assert mx.array_equal(out.swapaxes(1, 2), want) and mx.array_equal(new_state, want_state)
