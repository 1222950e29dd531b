"""The streamed bank: bit-identical to the resident bank, an LRU of slots, refusals by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core import native
from turbospark_core.errors import OptionError
from turbospark_core.experts import streamed as streamed_module
from turbospark_core.experts.layout import ExpertLayout
from turbospark_core.experts.plan import RESIDENT, STREAMED
from turbospark_core.experts.streamed import StreamedExpertBank
from turbospark_core.layers import ExpertBank, Experts

LAYER0 = "model.layers.0.mlp.experts"
ROLES = ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("kind", ["f32", "bf16", "q4", "mxfp4", "g16"])
@pytest.mark.parametrize(
    ("unpack", "in_place"),
    [(True, True), (True, False), (False, False)],
    ids=["float32-in-place", "float32-mlx-updates", "stored"],
)
def test_streamed_bank_equals_resident_bank_bit_for_bit(
    synthetic: Callable[[str], ExpertLayout],
    expert_store: Callable,
    silu_glu: Callable,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    unpack: bool,
    in_place: bool,
) -> None:
    if not in_place:  # the path for backends whose memory numpy cannot write (GPU)
        monkeypatch.setattr(streamed_module, "_writable_views", lambda held: None)
    layout = synthetic(kind)
    resident = expert_store(layout, RESIDENT, 6, unpack).bank(LAYER0, *ROLES)
    store = expert_store(layout, STREAMED, 2, unpack)
    streamed = store.bank(LAYER0, *ROLES)
    assert isinstance(resident, ExpertBank) and isinstance(streamed, StreamedExpertBank)
    assert isinstance(resident, Experts) and isinstance(streamed, Experts)  # one protocol for both
    # float32 slots are written in place through numpy views (CPU); stored-form slots (which the native
    # kernels multiply) through MLX updates
    float_slots = kind in ("f32", "bf16") or not native.keeps(layout.layers[LAYER0].projections["gate_proj"].quant)
    assert (streamed._views is not None) == (in_place and unpack and float_slots and mx.default_device() == mx.cpu)
    assert resident.num_experts == streamed.num_experts == 6
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((2, 5, 64)).astype(np.float32))
    for _ in range(4):  # decode-like (one token) and prefill-like (more experts than slots) batches
        idx = mx.array(rng.permuted(np.tile(np.arange(6), (2, 5, 1)), axis=-1)[..., :2].astype(np.uint32))
        for xs, ids in ((x[:1, :1], idx[:1, :1]), (x, idx)):
            want = resident.glu(xs, ids, silu_glu)
            got = streamed.glu(xs, ids, silu_glu)
            assert got.shape == want.shape and np.array_equal(np.array(got), np.array(want))
    assert store.stats().misses > 6  # the prefill batches reloaded experts


# ------------------------------------------------------------------ the LRU
def test_lru_keeps_the_most_recently_used_experts(
    synthetic: Callable[[str], ExpertLayout], expert_store: Callable, silu_glu: Callable
) -> None:
    layout = synthetic("f32")
    store = expert_store(layout, STREAMED, 3, unpack=True)
    bank = store.bank(LAYER0, *ROLES)
    x = mx.zeros((1, 1, 64))

    def route(*experts: int) -> None:
        mx.eval(bank.glu(x, mx.array([[list(experts)]], dtype=mx.uint32), silu_glu))

    route(0, 1)
    route(2, 0)  # 0 is a hit, 2 fills the free slot; 1 is now the least recently used
    assert bank.cached() == [1, 0, 2]
    route(3, 2)  # evicts 1
    assert bank.cached() == [0, 3, 2]
    stats = store.stats()
    assert (stats.hits, stats.misses) == (2, 4)
    assert stats.bytes_read == 4 * layout.layers[LAYER0].stride and stats.load_ms > 0 and stats.tokens == 3
    assert 0 < stats.hit_rate < 1


def test_router_out_of_range_and_too_few_slots_are_refused(
    synthetic: Callable[[str], ExpertLayout], expert_store: Callable, silu_glu: Callable
) -> None:
    bank = expert_store(synthetic("f32"), STREAMED, 2, unpack=True).bank(LAYER0, *ROLES)
    x = mx.zeros((1, 1, 64))
    with pytest.raises(OptionError, match=r"expert_slots=2 is below the 3 experts"):
        bank.glu(x, mx.array([[[0, 1, 2]]], dtype=mx.uint32), silu_glu)
    with pytest.raises(ValueError, match="chose expert 9"):
        bank.glu(x, mx.array([[[0, 9]]], dtype=mx.uint32), silu_glu)


def test_without_top_k_in_the_install_the_first_call_refuses(moe_copy: Path, tamper) -> None:
    tamper.edit(moe_copy, lambda raw: raw["experts"].__setitem__("top_k", None))
    runner = turbospark_core.open(moe_copy, residency="streamed", expert_slots=1)
    with pytest.raises(OptionError, match=r"expert_slots=1 is below the 2 experts the family routes"):
        runner.logits([1, 2, 3])
