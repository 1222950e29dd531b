"""The distributed weight stores: a rank reads only its share and hands the family the core's usual objects."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest

from turbospark_core.compute import ComputePolicy
from turbospark_core.distributed import world
from turbospark_core.distributed.plan import PipelinePlan, Split, TensorPlan
from turbospark_core.distributed.reader import ShardReader
from turbospark_core.distributed.share import StageShare, TensorShare
from turbospark_core.distributed.store import RemoteExperts, RemoteLinear, ShardedWeightStore, StageWeightStore
from turbospark_core.distributed.tensor import ExpertParallel, GatheredLinear, RowLinear, VocabEmbedding
from turbospark_core.errors import DistributedError
from turbospark_core.layers import Linear, fuse_linears
from turbospark_core.manifest import WEIGHTS, load_manifest
from turbospark_core.tensor_index import TensorIndex, build_index
from turbospark_core.weights import WeightStore

POLICY = ComputePolicy(unpack=True, compute_dtype=mx.float32, reason="test")


def _open(path: Path) -> tuple[Path, TensorIndex, ShardReader]:
    m = load_manifest(path)
    index = build_index(m.path(WEIGHTS), m.files[WEIGHTS].size, m.quantization)
    return m.path(WEIGHTS), index, ShardReader(m.path(WEIGHTS), m.files[WEIGHTS].size)


def test_a_tensor_rank_reads_its_slices_as_row_vocabulary_and_plain_objects(
    turbospark_install: Callable[..., Path],
) -> None:
    path, index, reader = _open(turbospark_install("llama"))
    plan = TensorPlan(
        splits={"*.o_proj": Split.into((4, 16)), "*.q_proj": Split.out((4, 16))},
        vocab=("lm_head", "model.embed_tokens"),
    )
    share = TensorShare(plan, index, 2, 1)
    store = ShardedWeightStore(path, index, POLICY, share, reader, world().handle)
    whole = WeightStore(path, index, POLICY)
    o = store.linear("model.layers.0.self_attn.o_proj")
    assert isinstance(o, RowLinear) and mx.array_equal(
        o.weight, whole.linear("model.layers.0.self_attn.o_proj").weight[:, 32:]
    )
    q = store.linear("model.layers.0.self_attn.q_proj")
    assert type(q) is Linear  # column-parallel: a plain linear over this rank's rows
    assert mx.array_equal(q.weight, whole.linear("model.layers.0.self_attn.q_proj").weight[32:])
    assert isinstance(store.linear("lm_head"), GatheredLinear)
    embed = store.embedding("model.embed_tokens")
    assert isinstance(embed, VocabEmbedding) and (embed.start, embed.count) == (256, 256)
    store.tensor("model.norm.weight")
    assert reader.bytes_read == (32 * 64 + 64 * 32 + 256 * 64 * 2) * 4 + 64 * 4


def test_a_tensor_rank_splits_routed_experts_by_expert(
    turbospark_install: Callable[..., Path], turbospark_fixtures: Path, tmp_path: Path
) -> None:
    from turbospark_core.convert import convert

    dst = tmp_path / "moe"
    convert(turbospark_fixtures / "qwen3_moe", dst, experts_file=False)
    path, index, reader = _open(dst)
    store = ShardedWeightStore(path, index, POLICY, TensorShare(TensorPlan(), index, 2, 1), reader, world().handle)
    bank = store.experts("model.layers.0.mlp.experts", "gate_proj", "up_proj", "down_proj")
    assert isinstance(bank, ExpertParallel) and (bank.first, bank.count, bank.num_experts) == (4, 4, 8)


def test_a_pipeline_rank_reads_nothing_of_other_ranks_layers(turbospark_install: Callable[..., Path]) -> None:
    path, index, reader = _open(turbospark_install("llama"))
    share = StageShare(PipelinePlan(), index, (1, 2), 2)
    store = StageWeightStore(path, index, POLICY, share, reader, {"model.layers.0.mlp.experts": 8})
    remote = store.linear("model.layers.0.self_attn.q_proj")
    assert isinstance(remote, RemoteLinear) and remote.out_features == 64 and remote.weight.shape == (64, 64)
    assert store.tensor("model.layers.0.input_layernorm.weight").shape == (64,)
    experts = store.experts("model.layers.0.mlp.experts", "gate_proj", "up_proj", "down_proj")
    assert isinstance(experts, RemoteExperts) and experts.num_experts == 8
    assert reader.bytes_read == 0
    assert fuse_linears([remote, store.linear("model.layers.0.self_attn.k_proj")]) is None  # nothing allocated
    with pytest.raises(DistributedError, match=r"'model.layers.0.self_attn.q_proj' belongs to a decoder layer another"):
        remote(mx.zeros((1, 64)))
    with pytest.raises(DistributedError, match="the flow does not run its decoder layers through the list"):
        experts.glu(mx.zeros((1, 64)), mx.zeros((1, 2), mx.uint32), lambda g, u: g)
    own = store.linear("model.layers.1.self_attn.q_proj")
    assert type(own) is Linear and reader.bytes_read == 64 * 64 * 4
    assert "model.layers.0.self_attn.q_proj.weight" not in store.unused()  # placeholders count as taken
