"""RoPE against transformers' rope init functions: default, linear, llama3, YaRN, partial rotary."""

from __future__ import annotations

import types
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.errors import ArchConfigError
from turbospark_core.rope import Rope

transformers = pytest.importorskip("transformers")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")

HEAD_DIM = 32
MAX_POSITIONS = 4096


class _Tensor(np.ndarray):
    """Just enough of torch.Tensor for the rope init functions."""

    def to(self, device: Any = None, dtype: Any = None) -> _Tensor:
        return (self if dtype is None else self.astype(dtype)).view(_Tensor)

    def float(self) -> _Tensor:
        return self.astype(np.float32).view(_Tensor)


def _arange(*args: Any, dtype: Any = None, **_: Any) -> _Tensor:
    return np.arange(*args).astype(dtype or np.int64).view(_Tensor)


# transformers computes inv_freq with torch (float32); torch is not a test dependency, so the
# functions run on this numpy stand-in (same dtypes, same formulas).
_TORCH = types.SimpleNamespace(
    arange=_arange,
    int64=np.int64,
    float=np.float32,
    float32=np.float32,
    clamp=np.clip,
    where=np.where,
    Tensor=_Tensor,
)


@pytest.fixture
def hf_rope(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``hf_rope(rope_type, params, theta, partial)`` -> (inv_freq, attention_factor) from transformers."""
    monkeypatch.setattr(rope_utils, "torch", _TORCH, raising=False)

    def compute(rope_type: str, params: dict[str, Any], theta: float, partial: float) -> tuple[np.ndarray, float]:
        rope_parameters = {"rope_type": rope_type, "rope_theta": theta, **params}
        if partial != 1.0:
            rope_parameters["partial_rotary_factor"] = partial
        config = transformers.LlamaConfig(
            hidden_size=HEAD_DIM * 2,
            num_attention_heads=2,
            head_dim=HEAD_DIM,
            max_position_embeddings=MAX_POSITIONS,
            rope_parameters=rope_parameters,
        )
        inv, attention = rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, None)
        return np.asarray(inv, dtype=np.float32), float(attention)

    return compute


def _hf_apply(q: np.ndarray, inv: np.ndarray, attention: float, positions: np.ndarray) -> np.ndarray:
    """transformers' apply_rotary_pos_emb (rotate_half layout) on the first 2*len(inv) features."""
    dim = 2 * len(inv)
    freqs = positions[:, None].astype(np.float64) * inv[None, :].astype(np.float64)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb) * attention, np.sin(emb) * attention
    rot, rest = q[..., :dim], q[..., dim:]
    rotate_half = np.concatenate([-rot[..., dim // 2 :], rot[..., : dim // 2]], axis=-1)
    return np.concatenate([rot * cos + rotate_half * sin, rest], axis=-1)


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0}

def _same(case_id: str, rope_type: str, params: dict[str, Any], theta: float = 10000.0, partial: float = 1.0) -> Any:
    """A case whose rope_scaling is exactly transformers' rope parameters."""
    return pytest.param({"rope_type": rope_type, **params}, rope_type, params, theta, partial, id=case_id)


def _default(case_id: str, ours: dict[str, Any] | None, partial: float = 1.0) -> Any:
    # transformers' "linear" with factor 1 is exactly its default inv_freq
    return pytest.param(ours, "linear", {"factor": 1.0}, 10000.0, partial, id=case_id)


CASES = [
    _default("default", None),
    _default("default-explicit", {"rope_type": "default"}),
    _default("default-partial", None, partial=0.5),
    _same("linear", "linear", {"factor": 4.0}),
    pytest.param({"type": "linear", "factor": 2.0}, "linear", {"factor": 2.0}, 10000.0, 1.0, id="linear-legacy-key"),
    _same("llama3", "llama3", LLAMA3, theta=500000.0),
    _same("llama3-partial", "llama3", LLAMA3, theta=500000.0, partial=0.5),
    _same("yarn", "yarn", YARN),
    _same("yarn-truncate-true", "yarn", {**YARN, "truncate": True}, theta=150000.0),
    _same("yarn-truncate-false", "yarn", {**YARN, "truncate": False}, theta=150000.0),
    _same("yarn-partial", "yarn", YARN, partial=0.5),
    _same("yarn-partial-no-truncate", "yarn", {**YARN, "truncate": False}, partial=0.25),
    _same("yarn-attention-factor", "yarn", {**YARN, "attention_factor": 0.8}),
    _same("yarn-mscale", "yarn", {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707}),
]


@pytest.mark.parametrize(("scaling", "hf_type", "hf_params", "theta", "partial"), CASES)
@pytest.mark.parametrize("offset", [0, 37])
def test_rope_matches_transformers(
    hf_rope: Any,
    scaling: dict[str, Any] | None,
    hf_type: str,
    hf_params: dict[str, Any],
    theta: float,
    partial: float,
    offset: int,
) -> None:
    inv, attention = hf_rope(hf_type, hf_params, theta, partial)
    dims = int(HEAD_DIM * partial)
    assert 2 * len(inv) == dims
    rope = Rope.from_config(dims=dims, theta=theta, scaling=scaling, max_positions=MAX_POSITIONS)
    assert rope.dims == dims

    q = np.random.default_rng(0).normal(size=(1, 3, 16, HEAD_DIM)).astype(np.float32)
    ours = np.array(rope(mx.array(q), offset=offset))
    expected = _hf_apply(q.astype(np.float64), inv, attention, np.arange(offset, offset + q.shape[2]))
    assert np.abs(ours - expected).max() < 1e-5
    if dims < HEAD_DIM:  # features past the rotary dims pass through untouched
        np.testing.assert_array_equal(ours[..., dims:], q[..., dims:])


def test_rope_is_relative() -> None:
    # <R(m) q, R(n) k> depends only on m - n: the property attention relies on
    scaling = {"rope_type": "llama3", **LLAMA3}
    rope = Rope.from_config(dims=HEAD_DIM, theta=10000.0, scaling=scaling, max_positions=MAX_POSITIONS)
    rng = np.random.default_rng(1)
    q, k = (mx.array(rng.normal(size=(1, 1, 1, HEAD_DIM)).astype(np.float32)) for _ in range(2))
    near = float((rope(q, offset=7) * rope(k, offset=3)).sum())
    far = float((rope(q, offset=107) * rope(k, offset=103)).sum())
    assert abs(near - far) < 1e-4


@pytest.mark.parametrize("rope_type", ["longrope", "dynamic", "made_up"])
def test_unknown_rope_type_is_refused_by_name(rope_type: str) -> None:
    with pytest.raises(ArchConfigError) as err:
        Rope.from_config(dims=16, theta=10000.0, scaling={"rope_type": rope_type, "factor": 2.0}, max_positions=128)
    msg = str(err.value)
    assert repr(rope_type) in msg
    assert all(t in msg for t in ("default", "linear", "llama3", "yarn"))  # what is supported


@pytest.mark.parametrize("dims", [0, -2, 15])
def test_bad_rotary_dims_are_refused(dims: int) -> None:
    with pytest.raises(ArchConfigError, match=str(dims)):
        Rope.from_config(dims=dims, theta=10000.0, scaling=None, max_positions=128)
