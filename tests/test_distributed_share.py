"""One rank's share of an install: the slices tensor parallelism reads, the tensors a pipeline rank reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from turbospark_core.distributed.plan import PipelinePlan, Split, TensorPlan
from turbospark_core.distributed.share import Slice, StageShare, TensorShare, layer_costs
from turbospark_core.errors import DistributedError
from turbospark_core.manifest import WEIGHTS, load_manifest
from turbospark_core.tensor_index import TensorIndex, build_index
from turbospark_core.testing import llama_tensor_shapes, write_tiny_checkpoint

PLAN = TensorPlan(
    splits={
        "*.q_proj": Split.out((4, 16)),
        "*.k_proj": Split.out((2, 16)),
        "*.o_proj": Split.into((4, 16)),
        "*.gate_proj": Split.out(),
        "*.down_proj": Split.into(),
    },
    vocab=("model.embed_tokens", "lm_head"),
)
TINY = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "vocab_size": 96, "tie_word_embeddings": False,
}  # fmt: skip


def _index(path: Path) -> TensorIndex:
    m = load_manifest(path)
    return build_index(m.path(WEIGHTS), m.files[WEIGHTS].size, m.quantization)


@pytest.fixture(scope="module")
def llama(turbospark_install: Callable[..., Path]) -> TensorIndex:
    return _index(turbospark_install("llama"))


def test_tensor_share_slices_rows_columns_vocabulary_and_keeps_the_rest(llama: TensorIndex) -> None:
    shares = [TensorShare(PLAN, llama, 2, r) for r in range(2)]
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert [s.slice_of(q) for s in shares] == [Slice(0, ((0, 32),)), Slice(0, ((32, 64),))]
    assert [s.slice_of(o) for s in shares] == [Slice(1, ((0, 32),)), Slice(1, ((32, 64),))]
    assert shares[1].slice_of("lm_head.weight") == Slice(0, ((256, 512),))
    assert shares[1].slice_of("model.layers.0.mlp.down_proj.weight") == Slice(1, ((80, 160),))
    assert shares[0].slice_of("model.norm.weight") is None  # replicated
    assert shares[0].vocab_rows("model.embed_tokens") == (0, 256) and shares[0].is_row_parallel("x.o_proj")
    held = [s.local_index() for s in shares]
    replicated = sum(t.nbytes for n, t in llama.tensors.items() if shares[0].slice_of(n) is None)
    assert sum(h.stored_bytes() for h in held) == llama.stored_bytes() + replicated
    assert held[0].tensors[q].shape == (32, 64) and held[0].tensors[q].nbytes == 32 * 64 * 4


def test_vocabulary_that_the_group_does_not_divide_stays_whole(llama: TensorIndex) -> None:
    plan = TensorPlan(vocab=("lm_head",))
    assert TensorShare(plan, llama, 3, 0).vocab_rows("lm_head") is None  # 512 rows over 3 ranks
    assert TensorShare(plan, llama, 3, 0).slice_of("lm_head.weight") is None


def test_a_split_the_group_cannot_make_is_refused_at_construction(llama: TensorIndex) -> None:
    with pytest.raises(DistributedError, match=r"over 3 ranks cannot split 'model.layers.0.mlp.down_proj': its 160"):
        TensorShare(PLAN, llama, 3, 0)
    with pytest.raises(DistributedError, match=r"cannot split the heads of 'model.layers.0.self_attn.q_proj'=4"):
        TensorShare(TensorPlan(splits={"*.q_proj": PLAN.splits["*.q_proj"]}), llama, 3, 0)


def test_quantized_matrices_split_packed_words_and_groups(tmp_path: Path) -> None:
    from turbospark_core.convert import convert

    dst = tmp_path / "q4"
    convert(write_tiny_checkpoint(tmp_path / "hf", TINY, llama_tensor_shapes(TINY)), dst, quantize="q4", group_size=32)
    index = _index(dst)
    down = "model.layers.0.mlp.down_proj"
    assert index.quantization[down].bits == 4
    share = TensorShare(PLAN, index, 2, 1)
    assert share.slice_of(f"{down}.weight") == Slice(1, ((8, 16),))  # columns 64..128 of 4-bit: words 8..16
    assert share.slice_of(f"{down}.scales") == Slice(1, ((2, 4),))  # groups of 32
    held = share.local_index().tensors[f"{down}.weight"]
    assert held.shape == (64, 8) and held.nbytes == 64 * 8 * 4
    with pytest.raises(DistributedError, match=r"each rank's 16 input columns are not a multiple of its quantization"):
        TensorShare(PLAN, index, 8, 0)


def test_a_column_split_inside_a_packed_word_is_refused() -> None:
    from turbospark_core.distributed.share import _packed
    from turbospark_core.tensor_index import QuantSpec

    # 3-bit codes in groups of 16 (GGUF Q3_K): 16 columns are 48 bits, not a whole number of words
    q3 = QuantSpec(bits=3, group_size=16)
    with pytest.raises(DistributedError, match=r"16 input columns of 3-bit codes do not end on a 32-bit word"):
        _packed([(0, 16), (16, 32)], q3, "weight", "m", 2)
    assert _packed([(0, 32), (32, 64)], q3, "weight", "m", 2) == [(0, 3), (3, 6)]
    assert _packed([(0, 32), (32, 64)], q3, "scales", "m", 2) == [(0, 2), (2, 4)]


def test_routed_experts_split_by_expert(turbospark_fixtures: Path, tmp_path: Path) -> None:
    from turbospark_core.convert import convert

    dst = tmp_path / "moe"
    convert(turbospark_fixtures / "qwen3_moe", dst, experts_file=False)  # experts stacked in the weights file
    index = _index(dst)
    name = "model.layers.0.mlp.experts.gate_proj.weight"
    assert index.tensors[name].shape[0] == 8
    assert [TensorShare(TensorPlan(), index, 2, r).slice_of(name) for r in range(2)] == [
        Slice(0, ((0, 4),)),
        Slice(0, ((4, 8),)),
    ]
    with pytest.raises(DistributedError, match=r"num_experts of 'model.layers.0.mlp.experts'=8 \(not divisible by 3\)"):
        TensorShare(TensorPlan(), index, 3, 0)


def test_stage_share_keeps_all_but_other_ranks_layers(llama: TensorIndex) -> None:
    plan = PipelinePlan()
    first, second = StageShare(plan, llama, (0, 1), 2), StageShare(plan, llama, (1, 2), 2)
    assert first.holds("model.layers.0.mlp.down_proj.weight") and not first.holds("model.layers.1.mlp.down_proj.weight")
    assert first.holds("lm_head.weight") and second.holds("model.embed_tokens.weight")
    assert first.slice_of("model.layers.0.mlp.down_proj.weight") is None
    layers = [sum(t.nbytes for n, t in llama.tensors.items() if n.startswith(f"model.layers.{i}.")) for i in range(2)]
    assert layer_costs(llama, plan, 2, {}) == layers
    assert layer_costs(llama, plan, 2, {"model.layers.1.mlp.experts": 1000}) == [layers[0], layers[1] + 1000]
    rest = llama.stored_bytes() - sum(layers)
    assert first.local_index().stored_bytes() == rest + layers[0]
    assert StageShare(plan, llama, (10, 11), 12).holds("model.layers.10.x")  # layer 1's prefix is not layer 10's
