#!/usr/bin/env python
"""One decode step, compiled against uncompiled: graph nodes and step time per model.

For each model the script opens the install, prefills a prompt and then, in
alternating trials in the same process, times ``--steps`` greedy one-token
steps of the family's forward (each step evaluated with its caches, as the
runner does) with the family's compiled decode functions (every block's
``_decode_X = mx.compile(self._X)``) and with the plain ``_X`` swapped in (the
core's own compiled helpers stay on in both). Medians of wall and CPU time
(all threads) per step, and of the part of the wall time Python spends
building the step's graph (what compiling saves besides fusion). It also
counts the nodes of one step's graph (``mx.export_to_dot``: every primitive
MLX dispatches for the step, logits and cache writes included): with
``mx.compile`` off entirely, with the family's decode uncompiled, and compiled.

Models: ``--fixtures`` names shared reference fixtures (tiny random
checkpoints, converted into the work directory); ``--random`` builds random
bf16 checkpoints with the shapes of the ``compare_*.py`` scripts (their small
sizes: qwen, spark, gemma4-e, gemma4-moe, gptoss), converted as they are or
``--quantize``d; ``--install`` takes converted installs (SmolLM2, Gemma 3, ...).
``--compiled-only`` times the compiled steps alone, for A/B runs of two trees.

Usage::

    python benchmarks/decode_step.py --fixtures qwen3_5,gemma4_e [--random qwen,spark [--quantize q4]]
        [--install DIR ...] [--steps 32] [--trials 5] [--workdir DIR] [--compiled-only] [--verbose]
"""

from __future__ import annotations

import argparse
import io
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import turbospark_core  # first: binds MLX's CPU matmuls before MLX loads  # isort: skip
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import workdir

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
PROMPT = 32


def random_checkpoint(name: str, dst: Path) -> None:
    """The random bf16 checkpoint ``name`` (the ``compare_*.py`` scripts' small sizes) at ``dst`` (reused)."""
    import compare_gemma4
    import compare_gptoss
    import compare_qwen
    import compare_spark

    if name == "qwen":
        compare_qwen.random_checkpoint(dst, compare_qwen.SIZES["small"])
    elif name == "spark":
        compare_spark.random_checkpoint(dst, "small")
    elif name in ("gemma4-e", "gemma4-moe"):
        compare_gemma4.random_gemma4_checkpoint(dst, compare_gemma4.TEXT_CONFIGS[name.removeprefix("gemma4-")])
    elif not (dst / "config.json").exists():
        config = compare_gptoss.gpt_oss_config(layers=8, hidden=512, experts=16)
        compare_gptoss.write_checkpoint(dst, config, compare_gptoss.random_weights(config))


def converted(src: Path, dst: Path, quantize: str | None = None) -> Path:
    from turbospark_core.convert import convert

    if not (dst / "manifest.json").exists():
        convert(src, dst, quantize=quantize)
    return dst


def graph_nodes(outputs: list[mx.array]) -> Counter[str]:
    """Primitives in the graph of ``outputs`` (before evaluation), by name."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *outputs)
    return Counter(re.findall(r'label ="([A-Za-z_]+)', buf.getvalue()))


class Decoder:
    """Greedy one-token steps of a runner's family forward over fresh caches."""

    def __init__(self, runner: Any, prompt: list[int]) -> None:
        self.model, self.opened, self.prompt = runner.model, runner.opened, prompt

    def start(self) -> tuple[list[Any], mx.array]:
        cache = self.opened.new_cache()
        logits = self.model(mx.array([self.prompt]), cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token, [c.state for c in cache])
        return cache, token

    def step(self, cache: list[Any], token: mx.array) -> list[mx.array]:
        logits = self.model(token, cache)
        return [mx.argmax(logits[:, -1:], axis=-1), *[a for c in cache for a in c.state]]

    def run(self, steps: int) -> tuple[float, float, float]:
        """Median seconds per step over ``steps`` steps, after two warm-up steps: wall, CPU (all threads), and
        the wall time Python spends building the step's graph (before it is evaluated)."""
        cache, token = self.start()
        wall, cpu, build = [], [], []
        for i in range(steps + 2):
            t0, c0 = time.perf_counter(), time.process_time()
            out = self.step(cache, token)
            t1 = time.perf_counter()
            mx.eval(out)
            token = out[0]
            if i >= 2:
                wall.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                build.append(t1 - t0)
        return statistics.median(wall), statistics.median(cpu), statistics.median(build)

    def nodes(self) -> Counter[str]:
        cache, token = self.start()
        mx.eval(self.step(cache, token))  # traces (compiled) happen here, not in the counted step
        return graph_nodes(self.step(cache, token))


def family_compile(model: Any, on: bool) -> None:
    """Swap each block's compiled ``_decode_X`` for its plain ``_X`` (``on=False``) or back.

    With them off the step runs exactly the family's decode ops uncompiled while
    the core's own compiled helpers stay on: the family's share, in one process.
    """
    for block in model.layers:
        saved = block.__dict__.setdefault("_bench_compiled", {})
        for name in [n for n in vars(block) if n.startswith("_decode_")]:
            plain = getattr(block, name.removeprefix("_decode"), None)
            if plain is None:
                continue
            saved.setdefault(name, getattr(block, name))
            setattr(block, name, saved[name] if on else plain)


def measure(name: str, install: Path, steps: int, trials: int, compiled_only: bool) -> dict[str, Any]:
    runner = turbospark_core.open(install)
    vocab = runner.manifest.arch["vocab_size"]
    dec = Decoder(runner, [(7 * i + 3) % vocab for i in range(PROMPT)])
    model = runner.model
    nodes = {"on": dec.nodes()}
    family_compile(model, False)
    nodes["family_off"] = dec.nodes()
    family_compile(model, True)
    mx.disable_compile()
    nodes["off"] = dec.nodes()
    mx.enable_compile()
    runs: dict[str, list[tuple[float, float, float]]] = {"on": [], "family_off": []}
    for _ in range(trials):  # alternating: the machine's load drifts
        runs["on"].append(dec.run(steps))
        if compiled_only:
            continue
        family_compile(model, False)
        runs["family_off"].append(dec.run(steps))
        family_compile(model, True)

    def ms(mode: str, which: int) -> float:
        got = runs[mode]
        return 1e3 * statistics.median(r[which] for r in got) if got else float("nan")

    out: dict[str, Any] = {"model": name}
    for mode in ("on", "family_off"):
        out[f"wall_{mode}"], out[f"cpu_{mode}"], out[f"build_{mode}"] = ms(mode, 0), ms(mode, 1), ms(mode, 2)
    for mode, counts in nodes.items():
        out[f"nodes_{mode}"], out[f"top_{mode}"] = sum(counts.values()), counts.most_common(8)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", default="", help="comma list of shared fixture names")
    ap.add_argument("--random", default="", help="comma list of: qwen, spark, gemma4-e, gemma4-moe, gptoss")
    ap.add_argument("--quantize", choices=["q4", "q8"], default=None, help="convert the random models quantized")
    ap.add_argument("--install", type=Path, action="append", default=[], help="a converted install (repeatable)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--compiled-only", action="store_true", help="time compiled steps only (A/B runs of two trees)")
    ap.add_argument("--verbose", action="store_true", help="also print the most frequent primitives")
    ap.add_argument("--workdir", type=Path, default=None, help="where models are converted (reused if given)")
    args = ap.parse_args(argv)
    with workdir(args.workdir, "ts-decode-step-") as work:
        models = [(n, converted(FIXTURES / n, work / f"fixture-{n}")) for n in filter(None, args.fixtures.split(","))]
        for n in filter(None, args.random.split(",")):
            random_checkpoint(n, work / f"random-{n}.hf")
            tag = f"{n}-{args.quantize}" if args.quantize else n
            models.append((f"random {tag}", converted(work / f"random-{n}.hf", work / f"random-{tag}", args.quantize)))
        models += [(p.name, p) for p in args.install]
        print(
            "| model | nodes / step: all uncompiled, family uncompiled -> compiled "
            "| wall ms / step: family uncompiled -> compiled | CPU ms / step | graph-building ms / step |"
        )
        print("|---|---|---|---|---|")
        for name, path in models:
            r = measure(name, path, args.steps, args.trials, args.compiled_only)
            print(
                f"| {name} | {r['nodes_off']}, {r['nodes_family_off']} -> {r['nodes_on']} "
                f"| {r['wall_family_off']:.2f} -> {r['wall_on']:.2f} "
                f"| {r['cpu_family_off']:.2f} -> {r['cpu_on']:.2f} "
                f"| {r['build_family_off']:.2f} -> {r['build_on']:.2f} |",
                flush=True,
            )
            if args.verbose:
                print(f"|   family uncompiled: {r['top_family_off']} | compiled: {r['top_on']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
