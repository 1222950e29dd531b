"""MoE expert streaming: a random qwen3_moe-shaped install whose experts are several GB,
opened streamed under a memory budget well below the experts' size, and resident for comparison.

Each configuration runs in a fresh process (peak RSS = VmHWM of /proc/self/status).
Routing comes from random router weights: close to uniform over experts, so the hit
rate is about slots / experts (real checkpoints route with more locality).

    python benchmarks/moe_streaming.py                      # build, measure, clean up
    python benchmarks/moe_streaming.py --dir /tmp/moe --keep --budget 2GB --tokens 32

Tokenizer files come from the qwen3_moe reference fixture (--fixtures, default shared/fixtures).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import turbospark_core  # first: the BLAS shim binds before MLX loads

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_mlx_lm as base  # (the sibling benchmark's measurement helpers)

HERE = Path(__file__).resolve()
DEFAULT_FIXTURES = HERE.parents[2] / "shared" / "fixtures"


# ------------------------------------------------------------------ building the install
def hf_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model_type": "qwen3_moe",
        "hidden_size": args.hidden,
        "intermediate_size": args.moe_intermediate * 4,
        "moe_intermediate_size": args.moe_intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": args.experts,
        "num_experts_per_tok": args.top_k,
        "norm_topk_prob": True,
        "vocab_size": args.vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
    }


def _tensors(args: argparse.Namespace, mx: Any) -> dict[str, Any]:
    """Lazy random bf16 tensors under install names (experts stacked ``[E, out, in]``)."""
    D, F, E, V = args.hidden, args.moe_intermediate, args.experts, args.vocab
    key = iter(mx.random.split(mx.random.key(0), 64 * args.layers + 8))

    def rand(*shape: int, scale: float = 0.02) -> Any:
        return (mx.random.normal(shape, key=next(key)) * scale).astype(mx.bfloat16)

    out = {"model.embed_tokens.weight": rand(V, D), "lm_head.weight": rand(V, D), "model.norm.weight": 1 + rand(D)}
    for i in range(args.layers):
        p = f"model.layers.{i}"
        out.update({
            f"{p}.input_layernorm.weight": 1 + rand(D),
            f"{p}.post_attention_layernorm.weight": 1 + rand(D),
            f"{p}.self_attn.q_proj.weight": rand(16 * 128, D),
            f"{p}.self_attn.k_proj.weight": rand(4 * 128, D),
            f"{p}.self_attn.v_proj.weight": rand(4 * 128, D),
            f"{p}.self_attn.o_proj.weight": rand(D, 16 * 128),
            f"{p}.self_attn.q_norm.weight": 1 + rand(128),
            f"{p}.self_attn.k_norm.weight": 1 + rand(128),
            f"{p}.mlp.gate.weight": rand(E, D, scale=1.0),
            f"{p}.mlp.experts.gate_proj.weight": rand(E, F, D),
            f"{p}.mlp.experts.up_proj.weight": rand(E, F, D),
            f"{p}.mlp.experts.down_proj.weight": rand(E, D, F),
        })
    return out


def build(args: argparse.Namespace, dst: Path) -> None:
    import mlx.core as mx

    from turbospark_core import plugins
    from turbospark_core.convert.experts import split_experts
    from turbospark_core.convert.writer import write_install

    src = Path(args.fixtures) / "qwen3_moe"
    config = hf_config(args)
    arch = plugins.arch_from_hf_config(config)
    texts = {n: (src / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")}
    tensors = _tensors(args, mx)
    resident, quant, pack = split_experts(tensors, {}, top_k=args.top_k)
    del tensors  # the pack holds the expert tensors, evaluated and let go one layer at a time
    dst.mkdir(parents=True)
    t0 = time.perf_counter()
    write_install(
        dst,
        arch=arch,
        tensors=resident,
        quantization=quant,
        text_files=texts,
        family="llama",
        distribution="turbospark-llama",
        provenance={"source": "benchmarks/moe_streaming.py (random)"},
        experts=pack,
    )
    size = (dst / "experts.bin").stat().st_size
    print(f"built {dst}: experts.bin {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


# ------------------------------------------------------------------ one measured configuration (child process)
def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    from turbospark_core.experts.store import ExpertStore

    root = Path(spec["install"])
    if spec.get("cold"):
        _drop_page_cache(root / "experts.bin")
    read_s = [0.0]
    plain_read = ExpertStore.read

    def timed_read(self: Any, *a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return plain_read(self, *a, **kw)
        finally:
            read_s[0] += time.perf_counter() - t

    ExpertStore.read = timed_read  # type: ignore[method-assign]
    if spec.get("stored"):  # force stored-form (bf16) expert slots instead of float32 ones
        import types

        import mlx.core as mx

        from turbospark_core import loader
        from turbospark_core.compute import ComputePolicy

        stored = ComputePolicy(unpack=False, compute_dtype=mx.float32, reason="stored form (forced by the benchmark)")
        loader.ComputePolicy = types.SimpleNamespace(choose=lambda **kw: stored)  # type: ignore[attr-defined]
    options = {k: spec[k] for k in ("residency", "expert_slots", "memory_budget") if spec.get(k) is not None}
    t0 = time.perf_counter()
    runner = turbospark_core.open(root, max_context=512, **options)
    open_s = time.perf_counter() - t0
    rss_open = base.proc_status_kb("VmHWM")
    read_open = read_s[0]
    prompt = list(range(3, 3 + spec["prompt"]))
    gen = runner.generate(prompt, max_tokens=spec["tokens"], temperature=0.0)
    est = runner.opened.estimate
    st = gen.stats
    ex = st.experts
    return {
        "name": spec["name"],
        "plan": runner.opened.experts.plan.describe(),
        "policy": runner.opened.policy.reason,
        "open_s": open_s,
        "estimate_gb": {"weights": est.weights / 1e9, "kv": est.kv / 1e9, "experts": est.experts / 1e9},
        "prefill_tps": st.prompt_tps,
        "decode_tps": st.generation_tps,
        "hit_rate": ex.hit_rate,
        "misses": ex.misses,
        "hits": ex.hits,
        "mb_read_per_token": ex.bytes_read / 1e6 / max(ex.tokens, 1),
        "load_ms_per_token": ex.load_ms_per_token,
        "read_ms_per_token": (read_s[0] - read_open) * 1e3 / max(ex.tokens, 1),
        "tokens_routed": ex.tokens,
        "peak_rss_gb": base.proc_status_kb("VmHWM") * 1024 / 1e9,
        "rss_after_open_gb": rss_open * 1024 / 1e9,
        "memory_budget_gb": runner.opened.options.memory_budget / 1e9,
        "decode_tokens": st.generation_tokens,
    }


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(HERE), "--run-one", json.dumps(spec)], capture_output=True, text=True, check=False
    )
    if out.returncode:
        print(out.stderr, file=sys.stderr)
        return {"name": spec["name"], "error": out.stderr.strip().splitlines()[-1] if out.stderr else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ report
def report(rows: list[dict[str, Any]], non_expert_gb: float) -> None:
    cols = ("name", "decode_tps", "prefill_tps", "hit_rate", "mb_read_per_token", "load_ms_per_token",
            "read_ms_per_token", "peak_rss_gb", "memory_budget_gb", "open_s")
    print(" | ".join(cols))
    for r in rows:
        if "error" in r:
            print(f"{r['name']} | error: {r['error']}")
            continue
        print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    for r in rows:
        if "error" not in r:
            bound = r["memory_budget_gb"] + non_expert_gb
            print(
                f"{r['name']}: {r['plan']} | {r['policy']} | peak RSS {r['peak_rss_gb']:.2f} GB vs budget + non-expert "
                f"weights {bound:.2f} GB | estimate {r['estimate_gb']}"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-one", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help="where to build the install (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the install afterwards")
    p.add_argument("--fixtures", default=os.environ.get("TURBOSPARK_FIXTURES", str(DEFAULT_FIXTURES)))
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--budget", default="2GB", help="memory_budget of the streamed runs")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--skip-resident", action="store_true")
    p.add_argument("--stored", action="store_true", help="also run streamed with stored-form (bf16) slots")
    args = p.parse_args()
    if args.run_one:
        print(json.dumps(run_one(json.loads(args.run_one))))
        return
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="moe_streaming_"))
    install = base / "install"
    try:
        if not (install / "manifest.json").exists():
            build(args, install)
        common = {"install": str(install), "tokens": args.tokens, "prompt": args.prompt}
        specs = [
            {**common, "name": "streamed (warm cache)", "residency": "streamed", "memory_budget": args.budget},
            {
                **common,
                "name": "streamed (cold cache)",
                "residency": "streamed",
                "memory_budget": args.budget,
                "cold": True,
            },
        ]
        if args.stored:
            specs.append(
                {
                    **common,
                    "name": "streamed bf16 slots",
                    "residency": "streamed",
                    "memory_budget": args.budget,
                    "stored": True,
                }
            )
        if not args.skip_resident:
            specs.append({**common, "name": "resident", "residency": "resident"})
        rows = [measure(s) for s in specs]
        non_expert = (install / "model_weights.safetensors").stat().st_size * 2 / 1e9  # bf16 -> float32
        report(rows, non_expert)
    finally:
        if not args.keep:
            shutil.rmtree(base if not args.dir else install, ignore_errors=True)


if __name__ == "__main__":
    main()
