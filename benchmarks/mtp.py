"""Per-step cost of the Qwen 3.5 MTP head on the reference fixtures (random weights: acceptance is not meaningful).

Measures, on the float32 installs of ``qwen3_5_mtp`` and ``qwen3_5_moe_mtp``:

* plain decode: ms per token of ``Runner.generate`` (greedy, ``--gen-tokens``);
* head: ms per head call (one slot on the head's KV cache, evaluated), i.e. the
  cost of each drafted token;
* propose(k): ms for one ``MtpDrafter.propose`` of ``k`` tokens after the
  committed slot (k = 1, 2, 3), the drafter's whole per-step overhead;
* overhead: propose(k) as a fraction of a plain decode step;
* end to end: greedy ``generate`` tok/s with ``mtp=1`` vs plain, in the same run,
  and the acceptance (``stats.accepted_tokens / stats.draft_tokens``).

Usage: ``python benchmarks/mtp.py [--fixtures DIR] [--gen-tokens 64] [--repeats 20]``.
Timings on a shared CPU are noisy: the table says what machine state it saw.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative import mtp

FIXTURES = ("qwen3_5_mtp", "qwen3_5_moe_mtp")


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _prefilled(runner: turbospark_core.Runner, prompt: list[int], depth: int) -> mtp.MtpDrafter:
    opened = runner.opened
    drafter = mtp.MtpDrafter(opened, mtp.load_head(opened), depth=depth)
    drafter.observe(0, {drafter.capture_layers[0]: mtp.trunk_residual(opened, prompt)[0]})
    return drafter


def measure(install: Path, refs: Any, gen: int, repeats: int) -> dict[str, float]:
    runner = turbospark_core.open(install)
    prompt = refs["prompt_ids"].tolist()
    out: dict[str, float] = {}
    out["decode_ms"] = _median_ms(lambda: runner.generate(prompt, max_tokens=gen), max(3, repeats // 5)) / gen
    drafter = _prefilled(runner, prompt, 3)
    context = [*prompt, int(refs["mtp_draft_token"][0])]
    step = drafter._commit(context)  # the committed slot; the chain below is what each draft token costs
    assert step is not None
    head, cache = drafter.head, drafter._cache

    def one_call() -> None:
        logits, _ = head(step[1], mx.array([[1]]), cache)
        mx.eval(logits)
        for c in cache:
            c.trim(1)  # type: ignore[union-attr]

    out["head_ms"] = _median_ms(one_call, repeats)
    greedy = Sampler(SamplingParams())
    for k in (1, 2, 3):

        def propose(k: int = k) -> None:
            drafter.propose(context, k, greedy)

        out[f"propose{k}_ms"] = _median_ms(propose, repeats)
    speculative = turbospark_core.open(install, mtp=1, num_draft_tokens=1)
    speculative.generate(prompt, max_tokens=8)  # warm
    runs = [speculative.generate(prompt, max_tokens=gen) for _ in range(3)]
    plain = [runner.generate(prompt, max_tokens=gen) for _ in range(3)]
    assert all(r.tokens == plain[0].tokens for r in runs)  # lossless
    out["plain_tps"] = statistics.median(r.stats.generation_tps for r in plain)
    out["mtp_tps"] = statistics.median(r.stats.generation_tps for r in runs)
    drafted, accepted = runs[0].stats.draft_tokens, runs[0].stats.accepted_tokens
    out["acceptance_k1"] = accepted / drafted if drafted else 0.0
    adaptive = turbospark_core.open(install, mtp="auto")  # the draft length adapts to acceptance and cost
    adaptive.generate(prompt, max_tokens=8)
    auto = [adaptive.generate(prompt, max_tokens=gen) for _ in range(3)]
    assert all(r.tokens == plain[0].tokens for r in auto)
    out["auto_tps"] = statistics.median(r.stats.generation_tps for r in auto)
    out["auto_drafted"] = auto[0].stats.draft_tokens
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.environ.get("TURBOSPARK_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures")
    parser.add_argument("--fixtures", type=Path, default=Path(default))
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"loadavg {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a loaded machine inflates every number)")
    print(
        "| fixture | decode ms/token | head ms/call | propose k=1 / 2 / 3 ms | propose k=1 / decode step "
        "| plain tok/s | mtp=1 tok/s | acceptance | mtp='auto' tok/s (drafted) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in FIXTURES:
            install = Path(tmp) / name
            convert(args.fixtures / name, install)
            r = measure(install, np.load(args.fixtures / name / "references_mtp.npz"), args.gen_tokens, args.repeats)
            print(
                f"| {name} | {r['decode_ms']:.2f} | {r['head_ms']:.2f} | "
                f"{r['propose1_ms']:.2f} / {r['propose2_ms']:.2f} / {r['propose3_ms']:.2f} | "
                f"{r['propose1_ms'] / r['decode_ms']:.0%} | {r['plain_tps']:.1f} | {r['mtp_tps']:.1f} "
                f"({r['mtp_tps'] / r['plain_tps']:.2f}x) | {r['acceptance_k1']:.0%} | "
                f"{r['auto_tps']:.1f} ({r['auto_tps'] / r['plain_tps']:.2f}x, {r['auto_drafted']:.0f}) |"
            )


if __name__ == "__main__":
    main()
