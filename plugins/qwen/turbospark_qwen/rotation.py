"""Which Qwen 3.5 tensors read and write the residual stream (for ``convert --rotate``)."""

from __future__ import annotations

from typing import Any

from turbospark_core.family import NormReaders, ResidualMap, names_under

# readers of the input norm: gated-DeltaNet input projections or attention projections
_MIXER_READERS = (
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
    "q_proj.weight", "k_proj.weight", "v_proj.weight",
)
# readers of the post-attention norm: dense MLP, router, routed and shared experts, the shared expert's gate
_MLP_READERS = ("gate_proj.weight", "up_proj.weight", ".gate.weight", "shared_expert_gate.weight")
_WRITERS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def residual_map(arch: dict[str, Any], names: list[str]) -> ResidualMap:
    """The residual readers and writers of every layer; the family's norms scale by ``1 + w``."""
    norms: list[NormReaders] = []
    writers: list[str] = []
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        mixer = tuple(n for n in names_under(names, p, _MIXER_READERS) if not n.startswith(p + "mlp."))
        norms.append(NormReaders(norm=f"{p}input_layernorm.weight", readers=mixer))
        mlp = names_under(names, p + "mlp.", _MLP_READERS)
        norms.append(NormReaders(norm=f"{p}post_attention_layernorm.weight", readers=mlp))
        writers.extend(names_under(names, p, _WRITERS))
    return ResidualMap(
        hidden_size=arch["hidden_size"],
        embedding="model.embed_tokens.weight",
        head="lm_head.weight",
        final_norm="model.norm.weight",
        norms=norms,
        writers=writers,
        norm_offset=1.0,
    )
