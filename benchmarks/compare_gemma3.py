#!/usr/bin/env python
"""turbospark (with the third-party turbospark-gemma3 plugin) vs mlx-lm on a random Gemma 3 checkpoint.

Builds a Hugging Face ``gemma3_text`` checkpoint directory of the requested
shape with random bfloat16 weights (normal * 0.02), converts it with
``turbospark_core.convert.convert``, loads the same directory with
``mlx_lm.load``, and prints prompt tok/s, generation tok/s, peak memory and
open time for both, with the ratios. Timing helpers come from
``compare_mlx_lm.py`` beside this file.

Sizes: ``270m`` is Gemma 3 270M's shape (hidden 640, 18 layers, 4 heads / 1 KV
head of 256, vocab 262144, window 512); ``tiny`` is a quick smoke run.

Usage::

    python benchmarks/compare_gemma3.py [--size 270m] [--prompt-tokens 128] [--gen-tokens 32] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import turbospark_core  # noqa: F401  first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_mlx_lm as base  # (the sibling benchmark's measurement helpers)
from common import arguments, parse, workdir, write_word_tokenizer

SIZES: dict[str, dict[str, Any]] = {
    "270m": {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "sliding_window": 512},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4,
             "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 32000, "sliding_window": 64},
}


def gemma3_config(size: str) -> dict[str, Any]:
    shape = SIZES[size]
    layers = shape["num_hidden_layers"]
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **shape,
        "rms_norm_eps": 1e-6, "query_pre_attn_scalar": shape["head_dim"], "sliding_window_pattern": 6,
        "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)],
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "max_position_embeddings": 32768,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }


def random_checkpoint(dst: Path, cfg: dict[str, Any], seed: int = 0) -> int:
    """A Hugging Face gemma3_text checkpoint with random bf16 weights; returns the parameter count."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.self_attn.q_proj.weight": (hq * hd, d), f"{p}.self_attn.k_proj.weight": (hkv * hd, d),
                   f"{p}.self_attn.v_proj.weight": (hkv * hd, d), f"{p}.self_attn.o_proj.weight": (d, hq * hd),
                   f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,),
                   f"{p}.mlp.gate_proj.weight": (f, d), f"{p}.mlp.up_proj.weight": (f, d),
                   f"{p}.mlp.down_proj.weight": (d, f)}
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            shapes[f"{p}.{norm}_layernorm.weight"] = (d,)
    mx.random.seed(seed)
    weights = {k: (mx.random.normal(s) * 0.02).astype(mx.bfloat16) for k, s in shapes.items()}
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return sum(int(np.prod(s)) for s in shapes.values())


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__, prompt_tokens=128, gen_tokens=32)
    parser.add_argument("--size", choices=sorted(SIZES), default="270m")
    args = parse(parser, argv)
    with workdir(args.workdir, "compare-gemma3-") as work:
        return compare(args, work)


def compare(args: argparse.Namespace, work: Path) -> int:
    cfg = gemma3_config(args.size)
    src, install = work / f"hf-{args.size}", work / f"install-{args.size}"
    if not (src / "config.json").exists():
        n = random_checkpoint(src, cfg)
        write_word_tokenizer(src, cfg["vocab_size"])
        base.log(f"random gemma3_text checkpoint ({n / 1e6:.0f}M parameters) at {src}")
    t0 = time.perf_counter()
    base.convert_install(src, install)
    convert_s = time.perf_counter() - t0
    ids = base.random_prompt_ids(cfg["vocab_size"], args.prompt_tokens)
    ts = base.bench_turbospark(install, ids, args.gen_tokens)
    ml = base.bench_mlx_lm(src, ids, args.gen_tokens)
    rows = [["runtime", "prompt tok/s", "gen tok/s", "peak mem (GB)", "open (s)"]]
    for name, r in (("turbospark", ts), ("mlx-lm", ml)):
        rows.append([name, f"{r['prompt_tps']:.1f}", f"{r['generation_tps']:.2f}", f"{r['peak_memory']:.3f}",
                     f"{r['open_s']:.2f}"])
    rows.append(["ratio ts/mlx-lm", f"{ts['prompt_tps'] / ml['prompt_tps']:.2f}",
                 f"{ts['generation_tps'] / ml['generation_tps']:.2f}",
                 f"{ts['peak_memory'] / ml['peak_memory']:.2f}", f"{ts['open_s'] / ml['open_s']:.2f}"])
    same, n = base.agreement(ts["tokens"], ml["tokens"])
    print(f"gemma3_text {args.size}: prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated; "
          f"convert {convert_s:.1f}s; greedy agreement {same}/{n} leading tokens")
    print(f"turbospark: {ts['note']}; mlx-lm: {ml['note']}")
    print(base.render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
