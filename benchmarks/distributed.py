"""Distributed decoding here: tokens/s at 1 rank and at 2 ranks (tensor, pipeline), and the collectives' latency.

The model is random, Qwen3-0.6B-shaped (hidden 1024, 16 / 8 heads of 128, intermediate 3072, vocab 151936,
tied head; ``--layers`` decoder layers, 28 by default), bf16 on disk, float32 on the CPU. Each measurement
is a fresh process (one rank) or two fresh ranks on loopback (ring backend, started as ``mlx.launch -n 2``
starts them); the modes are run in turn, ``--trials`` times, and the median of each is printed (a shared
machine: alternating trials and medians, not single readings). Two ranks on one machine share its cores:
each rank gets ``cores / 2`` threads (``TURBOSPARK_THREADS`` and ``OPENBLAS_NUM_THREADS``), the one
process all of them.

Per measurement: prefill tokens/s of a ``--prompt-tokens`` prompt, decode tokens/s over ``--gen-tokens``
(greedy), and, in a group, the median latency of one ``all_sum`` of a hidden-state row (4 KiB: what
tensor parallelism sums twice per layer and token) and of one pipeline hop (``send`` / ``recv`` of the
same row, measured as half a ping-pong). ``docs/distributed.md`` reports the numbers and the scaling model.

Usage: python benchmarks/distributed.py [--layers 28] [--trials 3] [--prompt-tokens 128] [--gen-tokens 32]
       [--workdir DIR]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import arguments, parse, workdir, write_word_tokenizer

MODEL = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}
MODES = ("one process", "tensor", "pipeline")
REPEATS = 200  # collective timings per measurement


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(dst: Path, layers: int) -> Path:
    """The random install (converted once; reused from ``--workdir``)."""
    install = dst / f"qwen3-{layers}"
    if (install / "manifest.json").exists():
        return install
    import mlx.core as mx

    from turbospark_core.convert import convert
    from turbospark_core.testing import llama_tensor_shapes

    config = {**MODEL, "num_hidden_layers": layers}
    shapes = llama_tensor_shapes(config)
    for i in range(layers):
        for norm in ("q_norm", "k_norm"):
            shapes[f"model.layers.{i}.self_attn.{norm}.weight"] = (config["head_dim"],)
    src = dst / f"hf-{layers}"
    src.mkdir(parents=True, exist_ok=True)
    weights = {
        n: (mx.ones(s) + 0.1 * mx.random.normal(s) if len(s) == 1 else 0.02 * mx.random.normal(s)).astype(mx.bfloat16)
        for n, s in shapes.items()
    }
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps(config))
    write_word_tokenizer(src, config["vocab_size"])
    convert(src, install)
    return install


def measure(install: Path, mode: str, prompt_tokens: int, gen_tokens: int, out: Path) -> None:
    """One measurement (one process, or every rank of a group); rank 0 writes ``out``."""
    import mlx.core as mx
    import numpy as np

    import turbospark_core

    distributed = None if mode == "one" else mode
    t0 = time.perf_counter()
    runner = turbospark_core.open(install, distributed=distributed, max_context=prompt_tokens + gen_tokens + 8)
    open_s = time.perf_counter() - t0
    prompt = [int(i) for i in np.random.default_rng(0).integers(3, MODEL["vocab_size"], prompt_tokens)]
    runner.generate(prompt[:16], max_tokens=4)  # warm-up: compiled decode steps, page cache
    stats = runner.generate(prompt, max_tokens=gen_tokens, temperature=0.0).stats
    result: dict[str, Any] = {"prefill_tps": stats.prompt_tps, "decode_tps": stats.generation_tps, "open_s": open_s}
    group = mx.distributed.init()
    if group.size() > 1:
        result |= collectives(group)
        result["info"] = runner.opened.distributed.describe()
    if group.rank() == 0:
        out.write_text(json.dumps(result))


def collectives(group: Any) -> dict[str, float]:
    """Median microseconds of an ``all_sum`` of one hidden row, and of one hop (half a send/recv ping-pong)."""
    import mlx.core as mx

    row = mx.ones((1, MODEL["hidden_size"]), mx.float32)
    sums, hops = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        mx.eval(mx.distributed.all_sum(row, group=group))
        sums.append(time.perf_counter() - t0)
    peer = 1 - group.rank()
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        if group.rank() == 0:
            mx.eval(mx.distributed.send(row, peer, group=group))
            mx.eval(mx.distributed.recv_like(row, peer, group=group))
        else:
            got = mx.distributed.recv_like(row, peer, group=group)
            mx.eval(mx.distributed.send(got, peer, group=group))
        hops.append((time.perf_counter() - t0) / 2)
    return {"all_sum_us": 1e6 * statistics.median(sums), "hop_us": 1e6 * statistics.median(hops)}


def run(install: Path, mode: str, args: Any, out: Path) -> dict[str, Any]:
    """One measurement in fresh processes: one, or two ranks on loopback (ring backend)."""
    me = [sys.executable, str(Path(__file__).resolve()), "--measure", mode, "--install", str(install)]
    me += ["--out", str(out), "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens)]
    if mode == "one":
        subprocess.run(me, check=True, timeout=1800, cwd=Path(__file__).parent)
    else:
        # The ranks are started as mlx.launch starts them (MLX_HOSTFILE, MLX_RANK), without its output
        # forwarding: on 2 cores its polling threads would take a share of the CPU the ranks measure.
        hostfile = out.with_suffix(".hosts.json")
        hostfile.write_text(json.dumps([[f"127.0.0.1:{args.port + r}"] for r in range(2)]))
        threads = str(max(1, (os.cpu_count() or 2) // 2))
        env = {**os.environ, "MLX_HOSTFILE": str(hostfile), "TURBOSPARK_THREADS": threads}
        env["OPENBLAS_NUM_THREADS"] = threads
        ranks = [subprocess.Popen(me, env={**env, "MLX_RANK": str(r)}, cwd=Path(__file__).parent) for r in range(2)]
        try:
            codes = [p.wait(timeout=1800) for p in ranks]
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise SystemExit(f"a rank failed ({codes})")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


# ------------------------------------------------------------------ the scaling model (docs/distributed.md)
Q4_BYTES = 4.5 / 8  # bytes per weight at 4 bits, group 64 (a scale and a bias per group, bf16)
MEMORY_BW = 400e9  # bytes/s a machine's decode reads weights at (e.g. 546 GB/s M4 Max class at ~75%)
LINKS = {  # one-way latency of one hop (s), bandwidth (bytes/s): assumptions, see docs/distributed.md
    "10 GbE": (30e-6, 1.25e9),
    "100 GbE": (12e-6, 12.5e9),
    "Thunderbolt 5": (8e-6, 8e9),
}
MODELS = {  # hidden, layers, vocab; weights read per token: attention, dense MLPs and head ("shared"), routed experts
    # (the k chosen of each layer's); the embedding table is only looked up. Qwen2.5-32B and Qwen3-235B-A22B shapes.
    "30B dense": {
        "hidden": 5120,
        "layers": 64,
        "vocab": 152064,
        "shared": 31.7e9,
        "experts": 0.0,
        "k": 0,
        "total": 32.5e9,
    },
    "235B MoE": {
        "hidden": 4096,
        "layers": 94,
        "vocab": 151936,
        "shared": 7.3e9,
        "experts": 14.2e9,
        "k": 8,
        "total": 235e9,
    },
}


def all_sum_s(ranks: int, payload: float, link: tuple[float, float]) -> float:
    """A ring ``all_sum`` of ``payload`` bytes: 2(N-1) steps, each one hop carrying payload/N."""
    latency, bandwidth = link
    return 2 * (ranks - 1) * (latency + payload / ranks / bandwidth)


def decode_ms(model: dict[str, float], mode: str, ranks: int, link: tuple[float, float]) -> tuple[float, float, float]:
    """Milliseconds per decoded token (one sequence): (weights read at MEMORY_BW, communication, total).

    Tensor: every rank reads 1/N of the active weights; per layer one ``all_sum`` of a bf16 hidden row after
    attention and one after the MLP (dense) or of the k routed experts' rows (MoE, expert parallel); the
    vocabulary-split head gathers its logits. Pipeline: the ranks read their layers one after the other
    (the whole active weights, in sequence), with N-1 hops of a hidden row and one ``all_sum`` sharing the
    last rank's hidden state.
    """
    row = 2 * model["hidden"]
    active = (model["shared"] + model["experts"]) * Q4_BYTES
    if mode == "pipeline":
        read = active / MEMORY_BW
        comm = (ranks - 1) * (link[0] + row / link[1]) + all_sum_s(ranks, row, link)
    else:
        read = active / ranks / MEMORY_BW
        second = row * max(model["k"], 1)  # the MLP's sum, or the routed experts' k rows
        per_layer = all_sum_s(ranks, row, link) + all_sum_s(ranks, second, link)
        gather = (ranks - 1) * (link[0] + 4 * model["vocab"] / ranks / link[1])
        comm = model["layers"] * per_layer + gather + all_sum_s(ranks, row, link)  # + the embedding lookup
    return 1e3 * read, 1e3 * comm, 1e3 * (read + comm)


def scaling_table() -> str:
    """The model's tokens/s for each model, link, mode and group size (markdown)."""
    lines = ["| model | link | mode | 2 machines | 4 machines | 8 machines |", "|---|---|---|---:|---:|---:|"]
    for name, model in MODELS.items():
        one = (model["shared"] + model["experts"]) * Q4_BYTES / MEMORY_BW
        fits = model["total"] * Q4_BYTES <= 128e9
        lines.append(
            f"| {name} | (one machine) | | {1 / one:.0f} tok/s" + ("" if fits else ", does not fit 128 GB") + " | | |"
        )
        for link_name, link in LINKS.items():
            for mode in ("tensor", "pipeline"):
                cells = []
                for n in (2, 4, 8):
                    read, comm, total = decode_ms(model, mode, n, link)
                    cells.append(f"{1e3 / total:.0f} ({read:.1f} + {comm:.1f} ms)")
                lines.append(f"| {name} | {link_name} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__ or "", prompt_tokens=128, gen_tokens=32)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--port", type=int, default=47310, help="the ring backend's first port (2 are used)")
    ap.add_argument("--model", action="store_true", help="print the scaling model's table (no measurement)")
    ap.add_argument("--measure", choices=("one", "tensor", "pipeline"), default=None, help=argparse_hidden())
    ap.add_argument("--install", type=Path, default=None, help=argparse_hidden())
    ap.add_argument("--out", type=Path, default=None, help=argparse_hidden())
    args = parse(ap, argv)
    if args.model:
        print(scaling_table())
        return
    if args.measure is not None:
        measure(args.install, args.measure, args.prompt_tokens, args.gen_tokens, args.out)
        return
    with workdir(args.workdir, "ts-distributed-") as work:
        install = build(work, args.layers)
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in ("one", "tensor", "pipeline")}
        for trial in range(args.trials):
            for mode in runs:
                got = run(install, mode, args, work / f"{mode}.json")
                runs[mode].append(got)
                log(f"trial {trial + 1}: {mode}: {got}")
    print(f"medians of {args.trials} trials")
    print("| mode | prefill tok/s | decode tok/s | all_sum of a row (us) | pipeline hop (us) |")
    print("|---|---:|---:|---:|---:|")
    for mode, results in runs.items():

        def med(key: str, results: list[dict[str, Any]] = results) -> str:
            values = [r[key] for r in results if key in r]
            return f"{statistics.median(values):.1f}" if values else "-"

        label = "1 process" if mode == "one" else f"2 ranks, {mode}"
        print(f"| {label} | {med('prefill_tps')} | {med('decode_tps')} | {med('all_sum_us')} | {med('hop_us')} |")


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
