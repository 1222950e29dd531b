#!/usr/bin/env python
"""turbospark vs mlx-lm on a random Spark 2.5-shaped model, side by side.

The script writes a Hugging Face checkpoint directory with random bfloat16
weights (normal * 0.02, norms at one) in the released Spark 2.5 layout
(``model.embedding``, fused ``self_attn.q_k_v_proj``, head-wise ``g_proj``,
``out_proj``, GELU gated MLP; three sliding-window layers then one full
layer, per-layer-type RoPE with a partial factor on the full layers, tied
head) plus a word-level tokenizer covering the vocabulary. turbospark
converts it (``turbospark_core.convert.convert``); mlx-lm loads the same
directory (``mlx_lm.load``). For each runtime in turn: open (timed), a short
warm-up, then one greedy generation of ``--gen-tokens`` tokens on the same
``--prompt-tokens`` random prompt ids. Prints prompt tok/s, generation tok/s,
peak memory (GB) and open time (s) for both, the ratios, and how many greedy
tokens agree. The prompt is longer than the sliding window by default, so the
ring KV cache (turbospark) and the rotating cache (mlx-lm) both wrap.

mlx-lm is a benchmark-only dependency: turbospark itself never imports it.

Usage::

    python benchmarks/compare_spark.py [--size small|base] [--prompt-tokens 512]
        [--gen-tokens 64] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import turbospark_core  # noqa: F401  first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_mlx_lm as base  # (shared child-process runners and report)
from common import SPECIALS, arguments, parse, workdir, write_word_tokenizer

_COMMON: dict[str, Any] = {
    "architectures": ["Spark2_5ForCausalLM"],
    "model_type": "spark2_5",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "hidden_act": "gelu",
    "gate_attn_act_mode": "sigmoid",
    "headwise_attn_output_gate": True,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        "full_attention": {"rope_theta": 1000000.0, "partial_rotary_factor": 0.5, "rope_type": "default"},
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

# base: ~0.45B parameters; small: ~0.05B, for a quick run
SIZES: dict[str, dict[str, Any]] = {
    "base": {
        "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
        "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000, "sliding_window": 256,
    },
    "small": {
        "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 16000, "sliding_window": 128,
    },
}






# ---------------------------------------------------------------- checkpoint
def spark_config(size: str) -> dict[str, Any]:
    """The config.json of a Spark 2.5-shaped model of ``size``."""
    cfg = {**_COMMON, **SIZES[size]}
    pattern = ["sliding_attention"] * 3 + ["full_attention"]
    cfg["layer_types"] = [pattern[i % 4] for i in range(cfg["num_hidden_layers"])]
    return cfg


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, by its released name."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embedding.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_k_v_proj.weight": ((heads + 2 * kv) * hd, h),
            f"{p}.self_attn.g_proj.weight": (heads, h),
            f"{p}.self_attn.out_proj.weight": (h, heads * hd),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        }
    return shapes


def random_checkpoint(dst: Path, size: str, seed: int = 0) -> int:
    """Write the random bf16 checkpoint (reused when present); returns the parameter count."""
    cfg = spark_config(size)
    shapes = tensor_shapes(cfg)
    n_params = sum(math.prod(s) for s in shapes.values())
    if (dst / "config.json").exists():
        base.log(f"reusing random checkpoint {dst}")
        return n_params
    base.log(f"writing random Spark 2.5 checkpoint ({n_params / 1e9:.3f}B params, bf16) to {dst}")
    dst.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    tensors = {
        name: mx.ones(shape, dtype=mx.bfloat16)
        if len(shape) == 1
        else (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)
        for name, shape in shapes.items()
    }
    mx.eval(tensors)
    mx.save_safetensors(str(dst / "model.safetensors"), tensors, metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    write_word_tokenizer(dst, cfg["vocab_size"])
    return n_params




# ---------------------------------------------------------------- runtimes




# ---------------------------------------------------------------- report




def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, prompt_tokens=512, gen_tokens=64)
    ap.add_argument("--size", choices=sorted(SIZES), default="base")
    args = parse(ap, argv)
    with workdir(args.workdir, "turbospark-spark-bench-") as work:
        return compare(args, work)


def compare(args: argparse.Namespace, work: Path) -> int:
    base.log(f"workdir {work}; MLX {mx.__version__} on {mx.default_device()}")
    ckpt, install = work / f"spark-{args.size}.hf", work / f"spark-{args.size}.turbospark"
    n_params = random_checkpoint(ckpt, args.size)
    base.convert_install(ckpt, install)
    cfg = spark_config(args.size)
    ids = np.random.default_rng(1).integers(len(SPECIALS), cfg["vocab_size"], size=args.prompt_tokens).tolist()
    result: dict[str, Any] = {
        "label": f"random spark2_5 {n_params / 1e9:.2f}B bf16",
        "prompt_tokens": len(ids),
        "note": "random weights: greedy ties make token agreement informative only for the first few tokens",
    }
    base.log("== turbospark")
    result["turbospark"] = base.run_worker("turbospark", install, ids, args.gen_tokens, work)
    base.log("== mlx-lm")
    result["mlx-lm"] = base.run_worker("mlx-lm", ckpt, ids, args.gen_tokens, work)
    print(
        f"turbospark vs mlx-lm ({time.strftime('%Y-%m-%d')}, MLX {mx.__version__}, {mx.default_device()}, "
        f"size {args.size}, window {cfg['sliding_window']}, prompt {args.prompt_tokens} tokens, "
        f"{args.gen_tokens} generated, greedy)"
    )
    print(base.report([result], None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
