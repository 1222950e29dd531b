"""The distributed open's refusals and shares, decided before anything is read (a group faked by its size)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core import plugins
from turbospark_core.distributed.group import world
from turbospark_core.distributed.plan import DistributedPlan, PipelinePlan, TensorPlan
from turbospark_core.distributed.setup import DistributedInfo, StageOpen, TensorOpen, mode_plan, refuse_options
from turbospark_core.errors import DistributedError
from turbospark_core.options import OpenOptions
from turbospark_core.testing import distributed_open

DUMMY = {"model_type": "dummy_lm", "hidden_size": 16, "vocab_size": 32}
DUMMY_TENSORS = {"model.embed_tokens.weight": (32, 16), "lm_head.weight": (32, 16)}


def _prepare(path: Path, size: int, rank: int = 0, **options: Any) -> Any:
    return distributed_open(path, options.pop("distributed", None), size, rank, **options)


def test_without_the_option_or_in_a_group_of_one_nothing_changes(turbospark_install: Callable[..., Path]) -> None:
    path = turbospark_install("llama")
    assert _prepare(path, 2) is None
    assert world().size == 1
    plain, split = turbospark_core.open(path), turbospark_core.open(path, distributed="pipeline")
    assert split.opened.distributed is None and type(split.model) is type(plain.model)
    assert np.array_equal(plain.logits([1, 2, 3]), split.logits([1, 2, 3]))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"router_histogram": True}, "router_histogram=True with distributed='tensor' is refused: each rank holds"),
        ({"ffn_histogram": True}, "ffn_histogram=True with distributed='tensor' is refused"),
        ({"vision": "sidecar"}, "vision='sidecar' with distributed='tensor' is refused: the vision tower is not split"),
        ({"ngram": 3}, "ngram with distributed='tensor' needs num_draft_tokens=K: the adaptive draft length is timed"),
    ],
)
def test_options_that_cannot_work_on_a_group_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(DistributedError, match=message.replace("(", r"\(").replace(")", r"\)")):
        refuse_options(OpenOptions(distributed="tensor", **options))
    refuse_options(OpenOptions(distributed="tensor", ngram=3, num_draft_tokens=2))  # a fixed draft length works


def test_an_unknown_mode_is_refused_by_the_option() -> None:
    with pytest.raises(
        turbospark_core.TurbosparkError, match=r"distributed='data' is invalid; choose one of None, 'tensor'"
    ):
        OpenOptions(distributed="data")


def test_a_family_without_a_plan_for_the_mode_is_refused_by_name(turbospark_tiny_install: Callable[..., Path]) -> None:
    hooks = plugins.family_hooks("llama")
    with pytest.raises(DistributedError, match=r"family 'llama' \(turbospark-llama\) declares no distributed plan"):
        mode_plan(None, "tensor", hooks, "llama")
    only_pipeline = DistributedPlan(tensor_refusal="heads are tied", pipeline=PipelinePlan())
    with pytest.raises(
        DistributedError,
        match=r"refuses distributed='tensor' for model type 'x': heads are tied; use distributed='pipeline'",
    ):
        mode_plan(only_pipeline, "tensor", hooks, "x")
    with pytest.raises(DistributedError, match=r"it declares no pipeline-parallel plan; use distributed='tensor'"):
        mode_plan(DistributedPlan(tensor=TensorPlan()), "pipeline", hooks, "x")
    bigram = turbospark_tiny_install("dummy", DUMMY, DUMMY_TENSORS)  # the test plugin's family declares no plan
    with pytest.raises(DistributedError, match=r"family 'dummy' \(turbospark-dummy\) declares no distributed plan"):
        _prepare(bigram, 2, distributed="pipeline")


def test_tensor_parallelism_builds_the_flow_from_per_rank_counts(turbospark_install: Callable[..., Path]) -> None:
    dist = _prepare(turbospark_install("qwen3_5_moe"), 2, 1, distributed="tensor")
    assert isinstance(dist, TensorOpen)
    assert {k: dist.arch[k] for k in ("num_attention_heads", "linear_num_key_heads", "hidden_size")} == {
        "num_attention_heads": 2,
        "linear_num_key_heads": 1,
        "hidden_size": 64,
    }
    experts = dist.held_experts()
    assert all(x.num_experts == 4 for x in experts.layers.values())
    whole = dist.experts.layers
    assert all(x.offset == whole[p].offset + 4 * whole[p].stride for p, x in experts.layers.items())  # experts 4-7
    info = dist.info()
    assert (
        info.rank == 1
        and "experts 4-7 of 8 per routed layer" in info.share
        and "linear_num_value_heads 2 of 4" in info.share
    )
    assert info.held_bytes < info.total_bytes


def test_tensor_parallelism_refusals_name_the_numbers(
    turbospark_install: Callable[..., Path], tmp_path: Path, turbospark_fixtures: Path
) -> None:
    from turbospark_core.convert import convert

    with pytest.raises(DistributedError, match=r"over 3 ranks cannot split num_attention_heads=4"):
        _prepare(turbospark_install("llama"), 3, distributed="tensor")
    with pytest.raises(
        DistributedError, match=r"refuses distributed='tensor' for model type 'minimax_m2': qk_norm='full'"
    ):
        _prepare(turbospark_install("minimax_m2"), 2, distributed="tensor")
    assert isinstance(_prepare(turbospark_install("minimax_m2"), 2, distributed="pipeline"), StageOpen)
    rotated = tmp_path / "rotated"
    convert(turbospark_fixtures / "llama", rotated, rotate=True)
    with pytest.raises(DistributedError, match=r"is hadamard-folded: its online transforms rotate whole rows"):
        _prepare(rotated, 2, distributed="tensor")


def test_pipeline_ranks_get_balanced_contiguous_layers(turbospark_install: Callable[..., Path]) -> None:
    ranks = [_prepare(turbospark_install("gemma4_e"), 2, r, distributed="pipeline") for r in range(2)]
    assert [d.layers for d in ranks] == [(0, 1), (1, 5)]  # layers 3 and 4 read the keys and values of 1 and 2
    assert ranks[1].share() == "decoder layers 1-4 of 5"
    layout = ranks[0].held_layout(tuple(plugins.family_hooks("gemma4").cache_layout(ranks[0].arch)))
    assert [spec.n_kv_heads for spec in layout] == [1, 0, 0]
    moe = [_prepare(turbospark_install("qwen3_5_moe"), 2, r, distributed="pipeline") for r in range(2)]
    assert [sorted(d.held_experts().layers) for d in moe] == [
        ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"],
        ["model.layers.2.mlp.experts", "model.layers.3.mlp.experts"],
    ]
    with pytest.raises(DistributedError, match="needs at least one decoder layer per rank, but the model has 2"):
        _prepare(turbospark_install("llama"), 4, distributed="pipeline")


def test_the_info_line_names_mode_rank_share_and_bytes() -> None:
    info = DistributedInfo(
        mode="pipeline", rank=1, size=4, share="decoder layers 8-15 of 32", held_bytes=2_500_000, total_bytes=10_000_000
    )
    assert info.describe() == (
        "pipeline parallel, rank 1 of 4: decoder layers 8-15 of 32; holds 2.50 MB of the install's 10.00 MB of weights"
    )


def test_the_memory_guard_counts_this_ranks_share_and_names_it(
    turbospark_install: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from turbospark_core.loader import _plan_memory
    from turbospark_core.memory import MemoryBudgetError

    path = turbospark_install("qwen3_5_moe")
    dist = _prepare(path, 2, 1, distributed="pipeline")
    layout = dist.held_layout(tuple(plugins.family_hooks("qwen3_5").cache_layout(dist.arch)))
    monkeypatch.setattr(dist, "agree", lambda flag: flag)  # the other rank's answer: the same
    held = _plan_memory(dist.held_index(), dist.held_experts(), layout, OpenOptions(distributed="pipeline"), 256, dist)
    whole = turbospark_core.open(path, max_context=256).opened.estimate
    assert held[2].weights + held[2].experts < whole.weights + whole.experts and held[2].kv < whole.kv
    tight = OpenOptions(distributed="pipeline", memory_budget=10_000)
    with pytest.raises(
        MemoryBudgetError, match=r"^rank 1 of 2 \(pipeline parallel, decoder layers 2-3 of 4\): opening"
    ):
        _plan_memory(dist.held_index(), dist.held_experts(), layout, tight, 256, dist)
    monkeypatch.setattr(dist, "agree", lambda flag: False)  # another rank cannot unpack: every rank keeps stored form
    policy = _plan_memory(
        dist.held_index(), dist.held_experts(), layout, OpenOptions(distributed="pipeline"), 256, dist
    )[0]
    assert not policy.unpack and "exceed the budget of another rank" in policy.reason
