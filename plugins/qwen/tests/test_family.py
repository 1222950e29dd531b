"""The flow's own refusals: Args validation, each naming the offender."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from turbospark_core.errors import ArchConfigError

from turbospark_qwen import convert, plugin
from turbospark_qwen.family import Args


@pytest.fixture
def arch(turbospark_fixtures: Path) -> dict:
    return convert.arch_from_hf(json.loads((turbospark_fixtures / "qwen3_5_moe" / "config.json").read_text()))


def test_valid_arch_has_no_problems(arch: dict) -> None:
    assert Args.problems(arch) == []
    args = Args.from_arch(arch)
    assert args.rotary_dim == 8 and args.moe is not None and args.moe.top_k == 2


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
         "sliding_attention"),
        ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
        ({"hidden_act": "gelu_pytorch_tanh"}, "gelu_pytorch_tanh"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"linear_num_key_heads": 3}, "linear_num_key_heads"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ({"rotary_dim": 40}, "rotary_dim"),
        ({"moe": {"num_experts": 4, "top_k": 5, "moe_intermediate_size": 8,
                  "shared_expert_intermediate_size": 8}}, "top_k"),
    ],
)
def test_unsupported_arch_refused_by_name(arch: dict, change: dict, named: str) -> None:
    bad = {**arch, **change}
    assert any(named in p for p in Args.problems(bad))
    with pytest.raises(ArchConfigError, match=named):
        Args.from_arch(bad)


def test_unknown_rope_type_refused_when_building(arch: dict) -> None:
    from turbospark_core.rope import Rope

    with pytest.raises(ArchConfigError, match="dynamic"):
        Rope.from_config(dims=8, theta=1e7, scaling={"rope_type": "dynamic", "factor": 2.0}, max_positions=64)


def test_probes(arch: dict) -> None:
    assert plugin.accepts_hadamard(arch) is True  # convert --rotate folds the rotation into the weights
    assert plugin.steering_supported(arch) is None
    assert plugin.kv_quant_unsupported_reason(arch, "q8") is None
