"""DFlash: the cost of one drafting round (drafter forward + verify) against plain decode steps, and the
acceptance length at which DFlash breaks even.

No DFlash weights for a model this runtime can load are on the registries, so both models are random:
a Qwen3-0.6B-shaped target (hidden 1024, 28 layers, 16 / 8 heads of 128, intermediate 3072, vocab
151936, tied head: 0.6B parameters, bf16 on disk, float32 on the CPU) and a z-lab-style drafter for it
(1 layer by default, the released Qwen3 drafters' attention and MLP shapes, ``block_size`` 16, reading
target layer ``L // 2``). A random drafter's drafts are all rejected, so a generation with a fixed
``num_draft_tokens = block_size - 1`` commits exactly one token per round: its time per token IS the
round's cost, end to end (drafter forward, verify forward of ``block_size`` tokens, capture, rewind).

A round that commits ``tau`` tokens on average (the mean acceptance length, accepted drafts + 1) beats
plain decoding when ``tau > round / step``: that ratio is the break-even acceptance length printed.

Usage: python benchmarks/dflash.py [--layers 28] [--drafter-layers 1] [--block-sizes 16] [--workdir DIR]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

import turbospark_core
from turbospark_core.convert import convert
from turbospark_core.kv_cache import trim_caches
from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative.dflash import DFlashFactory, dflash_factory
from turbospark_core.speculative.dflash_config import DFlashConfig, arch_from_hf
from turbospark_core.steering import Edit, applying
from turbospark_core.testing import llama_tensor_shapes, write_word_tokenizer

from common import arguments, parse, workdir

TARGET = {
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


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_target(dst: Path, config: dict[str, Any]) -> None:
    shapes = llama_tensor_shapes(config)
    for i in range(config["num_hidden_layers"]):
        shapes[f"model.layers.{i}.self_attn.q_norm.weight"] = (config["head_dim"],)
        shapes[f"model.layers.{i}.self_attn.k_norm.weight"] = (config["head_dim"],)
    write_weights(dst, config, shapes)
    write_word_tokenizer(dst, config["vocab_size"])


def write_drafter(dst: Path, target: dict[str, Any], layers: int, block_size: int) -> None:
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": target["vocab_size"] - 1},  # target_layer_ids: z-lab's default
        "num_target_layers": target["num_hidden_layers"],
        **{k: target[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim")},
        **{k: target[k] for k in ("num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings")},
        "num_hidden_layers": layers,
        "rope_theta": 1000000.0,
    }
    arch, problems = arch_from_hf(config)
    assert not problems, problems
    write_weights(dst, config, DFlashConfig.from_arch(arch).tensor_shapes())


def write_weights(dst: Path, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    weights = {}
    for name, shape in shapes.items():
        w = mx.ones(shape) + 0.1 * mx.random.normal(shape) if len(shape) == 1 else mx.random.normal(shape) * 0.02
        weights[name] = w.astype(mx.bfloat16)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=1))


def per_token_ms(runner: Any, prompt: list[int], gen: int, repeats: int) -> tuple[float, Any]:
    """Milliseconds per decode-loop step after the prefill (best of ``repeats``), and the last stats."""
    best, stats = float("inf"), None
    for _ in range(repeats):
        out = runner.generate(prompt, gen)
        stats = out.stats
        steps = stats.verify_steps or (stats.generation_tokens - 1)
        decode_s = stats.generation_tokens / stats.generation_tps
        best = min(best, 1e3 * decode_s / max(steps, 1))
    return best, stats


def verify_ms(runner: Any, prompt: list[int], block: int, layers: frozenset[int], repeats: int) -> float:
    """One target forward of ``block`` tokens after the prompt, capturing ``layers`` (best), rewound each time."""
    caches = runner.opened.new_cache()
    mx.eval(runner.model(mx.array([prompt]), caches))
    times = []
    for i in range(repeats + 1):
        got: dict[int, mx.array] = {}
        t0 = time.perf_counter()
        with applying(Edit({}), capture=got, capture_layers=layers):
            logits = runner.model(mx.array([prompt[:block]]), caches)
        mx.eval(logits, *got.values())
        if i:
            times.append(time.perf_counter() - t0)
        trim_caches(caches, block)
    return 1e3 * min(times)


def draft_ms(runner: Any, factory: DFlashFactory, prompt: list[int], accepted: int, repeats: int) -> float:
    """One drafter round (appending ``accepted + 1`` context rows, then the block forward), best time."""
    layers = factory.capture_layers
    got: dict[int, mx.array] = {}
    with applying(Edit({}), capture=got, capture_layers=frozenset(layers)):
        mx.eval(runner.model(mx.array([prompt]), runner.opened.new_cache()))
    T = len(prompt) - factory.block_size
    hidden = {layer: got[layer][0] for layer in layers}
    drafter = factory()
    drafter.observe(0, {layer: h[:T] for layer, h in hidden.items()})
    sampler = Sampler(SamplingParams())
    times = []
    for i in range(repeats + 1):
        drafter.rewind(T + 1)  # back to the prompt's context
        drafter.observe(T, {layer: h[T:] for layer, h in hidden.items()})  # a verify's rows
        drafter.rewind(T + accepted + 2)
        t0 = time.perf_counter()
        drafter.propose(prompt[: T + accepted + 2], factory.block_size - 1, sampler)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__ or "", prompt_tokens=128, gen_tokens=24)
    ap.add_argument("--layers", type=int, default=TARGET["num_hidden_layers"], help="target layers")
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--block-sizes", default="16", help="comma list of drafter block sizes")
    ap.add_argument("--repeats", type=int, default=2)
    args = parse(ap, argv)
    target_cfg = {**TARGET, "num_hidden_layers": args.layers}
    blocks = [int(b) for b in args.block_sizes.split(",")]
    with workdir(args.workdir, "ts-dflash-") as root:
        if not (root / "target" / "manifest.json").exists():
            log("writing and converting the random target ...")
            write_target(root / "target-src", target_cfg)
            convert(root / "target-src", root / "target", force=True)
        prompt = [int(t) for t in mx.random.randint(3, target_cfg["vocab_size"], (args.prompt_tokens,)).tolist()]
        log("plain decoding ...")
        plain = turbospark_core.open(root / "target")
        plain.generate(prompt[:16], 2)
        step, _ = per_token_ms(plain, prompt, args.gen_tokens, args.repeats)
        params = sum(v.size for v in mx.load(str(root / "target" / "model_weights.safetensors")).values())  # type: ignore[union-attr]
        rows = []
        for block in blocks:
            name = f"drafter-b{block}-l{args.drafter_layers}"
            if not (root / name / "manifest.json").exists():
                write_drafter(root / f"{name}-src", target_cfg, args.drafter_layers, block)
                convert(root / f"{name}-src", root / name, force=True)
            log(f"block {block}: rounds ...")
            runner = turbospark_core.open(root / "target", dflash=root / name, num_draft_tokens=block - 1)
            runner.generate(prompt[:16], 2)
            factory = dflash_factory(runner.opened.drafter)
            round_ms, stats = per_token_ms(runner, prompt, args.gen_tokens, args.repeats)
            verify = verify_ms(plain, prompt, block, frozenset(factory.capture_layers), args.repeats * 3)
            draft = draft_ms(runner, factory, prompt, 3, args.repeats * 3)
            rows.append((block, round_ms, draft, verify, stats))
        print(
            f"target: random qwen3, {params / 1e9:.2f}B params ({args.layers} layers), float32 on the CPU; "
            f"drafter: {args.drafter_layers} layer(s); prompt {len(prompt)} tokens, {args.gen_tokens} generated; "
            "loaded machine (shared cores)"
        )
        print(f"plain decode step: {step:.1f} ms ({1e3 / step:.1f} tok/s)")
        print("| block | round (end to end) | drafter forward | verify forward | round / step = break-even tau |")
        print("|---|---|---|---|---|")
        for block, round_ms, draft, verify, stats in rows:
            assert stats.accepted_tokens == 0, "a random drafter's drafts are never accepted"
            print(
                f"| {block} | {round_ms:.1f} ms | {draft:.1f} ms | {verify:.1f} ms | "
                f"{round_ms / step:.2f} (max tau {block}) |"
            )
        print(
            "speedup at mean acceptance length tau = tau * step / round; DFlash's published tau on real drafters: "
            "5.4 (Qwen3.5-4B, MLX), 6-8 (Qwen3-8B, b16)"
        )


if __name__ == "__main__":
    main()
