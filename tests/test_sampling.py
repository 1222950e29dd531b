"""Sampling: greedy, seeds, top-k / top-p / min-p, repetition penalty, temperature, refusals."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from turbospark_core.errors import OptionError
from turbospark_core.sampling import Sampler, SamplingOptions, SamplingParams

VOCAB = 32


def _logits(seed: int, batch: int = 4, vocab: int = VOCAB) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=(batch, vocab)).astype(np.float32) * 3)


def _draws(params: SamplingParams, logits: mx.array, n: int) -> np.ndarray:
    sampler = Sampler(params)
    return np.stack([np.array(sampler(logits)) for _ in range(n)])


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ------------------------------------------------------------------ greedy and seeds


@settings(max_examples=30, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(2, 64)), elements=st.floats(-50, 50, width=32)))
def test_greedy_is_argmax(logits: np.ndarray) -> None:
    picked = np.array(Sampler(SamplingParams())(mx.array(logits)))
    # ties: whichever the sampler picks must be a maximum of its row
    assert picked.shape == (logits.shape[0],)
    np.testing.assert_array_equal(logits[np.arange(len(picked)), picked], logits.max(axis=-1))


def test_greedy_ignores_the_seed() -> None:
    logits = _logits(0)
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    a = _draws(SamplingParams(seed=1), logits, 3)
    b = _draws(SamplingParams(seed=2), logits, 3)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[0], np.argmax(np.array(logits), axis=-1))


def test_same_seed_same_draws_different_seed_different_draws() -> None:
    logits = mx.zeros((4, VOCAB))  # uniform: every draw is pure randomness
    a = _draws(SamplingParams(temperature=1.0, seed=7), logits, 10)
    b = _draws(SamplingParams(temperature=1.0, seed=7), logits, 10)
    c = _draws(SamplingParams(temperature=1.0, seed=8), logits, 10)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(np.unique(a)) > 5  # successive draws differ: the key advances


# ------------------------------------------------------------------ truncation


def test_top_k_one_is_greedy() -> None:
    logits = _logits(1)
    draws = _draws(SamplingParams(temperature=1.5, top_k=1, seed=0), logits, 20)
    np.testing.assert_array_equal(draws, np.broadcast_to(np.argmax(np.array(logits), -1), draws.shape))


def test_top_k_restricts_support_to_the_k_best() -> None:
    logits = _logits(2, batch=1)
    draws = _draws(SamplingParams(temperature=5.0, top_k=3, seed=0), logits, 200)
    best3 = set(np.argsort(np.array(logits)[0])[-3:].tolist())
    assert set(draws.ravel().tolist()) == best3


def test_tiny_top_p_is_greedy() -> None:
    logits = _logits(3)
    draws = _draws(SamplingParams(temperature=2.0, top_p=1e-6, seed=0), logits, 20)
    np.testing.assert_array_equal(draws, np.broadcast_to(np.argmax(np.array(logits), -1), draws.shape))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = mx.array(np.log(np.tile(probs, (3000, 1))).astype(np.float32))
    # mass before token 2 is 0.8 >= 0.75: tokens 0 and 1 only; renormalised 5:3
    counts = np.bincount(np.array(Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0))(logits)), minlength=4)
    assert counts[2:].sum() == 0
    assert _chi_square(counts[:2], np.array([0.625, 0.375])) < 15


def test_top_p_zero_is_refused_or_greedy() -> None:
    logits = _logits(4)
    try:
        params = SamplingParams(temperature=1.0, top_p=0.0, seed=0)
    except OptionError as e:
        assert "top_p" in str(e)
        return
    draws = _draws(params, logits, 10)
    np.testing.assert_array_equal(draws, np.broadcast_to(np.argmax(np.array(logits), -1), draws.shape))


def test_min_p_drops_tokens_below_the_fraction_of_the_best() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = mx.array(np.log(np.tile(probs, (3000, 1))).astype(np.float32))
    # min_p=0.5: keep p >= 0.25 -> tokens 0 and 1, renormalised 5:3
    counts = np.bincount(np.array(Sampler(SamplingParams(temperature=1.0, min_p=0.5, seed=0))(logits)), minlength=4)
    assert counts[2:].sum() == 0
    assert _chi_square(counts[:2], np.array([0.625, 0.375])) < 15


def test_min_p_one_is_greedy() -> None:
    logits = _logits(5)
    draws = _draws(SamplingParams(temperature=1.0, min_p=1.0, seed=0), logits, 10)
    np.testing.assert_array_equal(draws, np.broadcast_to(np.argmax(np.array(logits), -1), draws.shape))


# ------------------------------------------------------------------ temperature


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    row = np.array([1.0, 0.5, 0.0, -0.5, -1.5], dtype=np.float32)
    n = 6000
    sampler = Sampler(SamplingParams(temperature=temperature, seed=1234))
    counts = np.bincount(np.array(sampler(mx.array(np.tile(row, (n, 1))))), minlength=len(row))
    probs = np.exp(row / temperature)
    probs /= probs.sum()
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5; the seed makes it deterministic anyway
    assert _chi_square(counts, probs) < 25, (counts, probs * n)


def test_higher_temperature_flattens_the_distribution() -> None:
    row = np.array([2.0, 0.0, -2.0], dtype=np.float32)
    logits = mx.array(np.tile(row, (4000, 1)))
    cold = np.array(Sampler(SamplingParams(temperature=0.3, seed=0))(logits))
    hot = np.array(Sampler(SamplingParams(temperature=3.0, seed=0))(logits))
    assert (cold == 0).mean() > 0.99
    assert 0.4 < (hot == 0).mean() < 0.6


# ------------------------------------------------------------------ repetition penalty


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = mx.array([[2.0, -1.0, 0.5, -3.0, 4.0]])
    out = Sampler(SamplingParams(repetition_penalty=2.0)).penalize(mx.array(logits), mx.array([0, 1, 1]))
    # token 1 repeated twice is still penalised once (HF / mlx-lm semantics)
    np.testing.assert_allclose(np.array(out), [[1.0, -2.0, 0.5, -3.0, 4.0]])


@settings(max_examples=25, deadline=None)
@given(
    arrays(np.float32, (1, 16), elements=st.floats(-20, 20, width=32)),
    st.lists(st.integers(0, 15), min_size=1, max_size=10),
    st.floats(1.01, 10.0),
)
def test_repetition_penalty_lowers_exactly_the_seen_tokens(
    logits: np.ndarray, history: list[int], penalty: float
) -> None:
    out = np.array(Sampler(SamplingParams(repetition_penalty=penalty)).penalize(mx.array(logits), mx.array(history)))
    seen = np.zeros(16, bool)
    seen[history] = True
    expected = np.where(logits < 0, logits * penalty, logits / penalty)
    np.testing.assert_allclose(out[0, seen], expected[0, seen], rtol=1e-6)
    np.testing.assert_array_equal(out[0, ~seen], logits[0, ~seen])
    assert (out[0, seen] <= logits[0, seen]).all()


def test_repetition_penalty_one_or_no_history_is_a_no_op() -> None:
    logits = _logits(6, batch=1)
    same = Sampler(SamplingParams(repetition_penalty=1.0)).penalize(mx.array(logits), mx.array([0, 1]))
    empty = Sampler(SamplingParams(repetition_penalty=1.5)).penalize(mx.array(logits), mx.array([], dtype=mx.int32))
    np.testing.assert_array_equal(np.array(same), np.array(logits))
    np.testing.assert_array_equal(np.array(empty), np.array(logits))


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = mx.array([[3.0, 2.5, 0.0]])
    sampler = Sampler(SamplingParams(repetition_penalty=1.5))
    assert sampler(sampler.penalize(logits, mx.array([0]))).item() == 1


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 1.5),
        ("top_p", -0.1),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("top_k", -1),
    ],
)
def test_bad_params_are_refused_by_name(param: str, value: float) -> None:
    with pytest.raises(OptionError, match=param) as err:
        SamplingParams(**{param: value})
    assert repr(value) in str(err.value) or str(value) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_the_typed_sampling_options_are_the_params_and_stop() -> None:
    # Runner/Session methods take ``**sampling: Unpack[SamplingOptions]``: one typed list for all eight
    assert set(SamplingOptions.__annotations__) == {f.name for f in attrs.fields(SamplingParams)} | {"stop"}
    assert SamplingOptions.__total__ is False  # every option may be left out
