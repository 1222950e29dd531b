"""The flow's own refusals at open: Args validation, each problem naming its key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turbospark_core.errors import ArchConfigError

from turbospark_deepseek import convert
from turbospark_deepseek.args import Args


@pytest.fixture
def arch(turbospark_fixtures: Path) -> dict[str, Any]:
    return convert.arch_from_hf(json.loads((turbospark_fixtures / "deepseek_v2_qlora" / "config.json").read_text()))


def test_valid_arch_has_no_problems(arch: dict[str, Any]) -> None:
    assert Args.problems(arch) == []
    args = Args.from_arch(arch)
    assert args.q_head_dim == 24 and args.moe is not None and args.moe.topk_group == 2
    (spec,) = set(args.cache_layout())
    assert (spec.n_kv_heads, spec.head_dim, spec.value_dim) == (1, 40, 0)  # [c | k_r], no values


def _moe(arch: dict[str, Any], **change: Any) -> dict[str, Any]:
    return {**arch, "moe": {**arch["moe"], **change}}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda a: {**a, "model_type": "deepseek_v4"}, "deepseek_v4"),
        (lambda a: {**a, "model_type": "llama"}, "model type 'llama'"),
        (lambda a: {**a, "kv_lora_rank": 0}, "kv_lora_rank"),
        (lambda a: {**a, "qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        (lambda a: {**a, "q_lora_rank": "big"}, "q_lora_rank"),
        (lambda a: {**a, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        (lambda a: _moe(a, scoring="sigmoid"), "scoring/topk_method"),
        (lambda a: _moe(a, norm_topk_prob=True), "norm_topk_prob"),
        (lambda a: _moe(a, n_group=3), "n_group"),
        (lambda a: _moe(a, topk_group=5), "topk_group"),
        (lambda a: _moe(a, top_k=9), "top_k"),
        (lambda a: _moe(a, top_k=5, topk_group=1), "top_k"),
        (lambda a: _moe(a, routed_scaling_factor=-1.0), "routed_scaling_factor"),
        (lambda a: _moe(a, aux_loss_alpha=0.001), "aux_loss_alpha"),
        (lambda a: {**a, "moe_intermediate_size": None}, "moe_intermediate_size"),
    ],
)
def test_unsupported_arch_refused_by_name(arch: dict[str, Any], change: Any, named: str) -> None:
    bad = change(arch)
    assert any(named in p for p in Args.problems(bad)), Args.problems(bad)
    with pytest.raises(ArchConfigError, match=named.replace("/", ".")):
        Args.from_arch(bad)
