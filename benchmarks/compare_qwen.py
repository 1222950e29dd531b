#!/usr/bin/env python
"""turbospark vs mlx-lm on a random Qwen 3.5-shaped (gated-DeltaNet hybrid) model, side by side.

The script writes a Hugging Face checkpoint directory (``model_type`` ``qwen3_5``,
``model.language_model.*`` names, bf16 random normal * 0.02, with ``A_log`` and
the gated-norm weights float32 as in released checkpoints), converts it with
``turbospark_core.convert.convert`` and loads the same directory with
``mlx_lm.load``. For each runtime in turn it opens the model (timed), warms up,
resets MLX's peak-memory counter and runs one greedy generation on the same
prompt ids, then prints prompt tok/s, generation tok/s, peak memory and open
time for both, and the ratios.

``--recurrence`` also times the gated delta rule alone at the model's shapes:
turbospark's chunked prefill against the token-by-token compiled step (one
lazy graph either way).

Sizes: ``0.5b`` (0.56B: 24 layers, hidden 1024, Qwen3.5-0.8B's layer shapes
with a 32k vocabulary, untied head) is the default; ``small`` (0.08B: 12
layers, hidden 512) is a quick check.

mlx-lm is a benchmark-only dependency: turbospark itself never imports it.

Usage::

    python benchmarks/compare_qwen.py [--size 0.5b|small] [--prompt-tokens 128]
        [--gen-tokens 32] [--workdir DIR] [--recurrence] [--f32-check]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import turbospark_core  # first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_mlx_lm as base  # (shared child-process runners and report)
from common import arguments, parse, workdir, write_word_tokenizer

_COMMON: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "attention_bias": False,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "full_attention_interval": 4,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
}
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        **_COMMON,
        "hidden_size": 512,
        "num_hidden_layers": 12,
        "intermediate_size": 1536,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
    },
    "0.5b": {
        **_COMMON,
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "intermediate_size": 3584,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
    },
}






# ---------------------------------------------------------------- checkpoint
def tensor_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face Qwen 3.5 text checkpoint of config ``c``."""
    h, hd = c["hidden_size"], c["head_dim"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim, n_v = c["linear_num_value_heads"] * c["linear_value_head_dim"], c["linear_num_value_heads"]
    conv_dim = 2 * key_dim + value_dim
    inter = c["intermediate_size"]
    root = "model.language_model"
    shapes: dict[str, tuple[int, ...]] = {
        f"{root}.embed_tokens.weight": (c["vocab_size"], h),
        f"{root}.norm.weight": (h,),
        "lm_head.weight": (c["vocab_size"], h),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"{root}.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        }
        if (i + 1) % c["full_attention_interval"]:
            a = f"{p}.linear_attn"
            shapes |= {
                f"{a}.in_proj_qkv.weight": (conv_dim, h),
                f"{a}.in_proj_z.weight": (value_dim, h),
                f"{a}.in_proj_b.weight": (n_v, h),
                f"{a}.in_proj_a.weight": (n_v, h),
                f"{a}.conv1d.weight": (conv_dim, 1, c["linear_conv_kernel_dim"]),
                f"{a}.dt_bias": (n_v,),
                f"{a}.A_log": (n_v,),
                f"{a}.norm.weight": (c["linear_value_head_dim"],),
                f"{a}.out_proj.weight": (h, value_dim),
            }
        else:
            s = f"{p}.self_attn"
            n, kv = c["num_attention_heads"], c["num_key_value_heads"]
            shapes |= {
                f"{s}.q_proj.weight": (2 * n * hd, h),
                f"{s}.k_proj.weight": (kv * hd, h),
                f"{s}.v_proj.weight": (kv * hd, h),
                f"{s}.o_proj.weight": (h, n * hd),
                f"{s}.q_norm.weight": (hd,),
                f"{s}.k_norm.weight": (hd,),
            }
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...]) -> mx.array:
    if name.endswith("A_log"):  # float32, as released checkpoints keep it
        return mx.log(mx.random.uniform(1.0, 16.0, shape))
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + mx.random.normal(shape) * 0.02
    if name.endswith("dt_bias"):
        return mx.ones(shape, dtype=mx.bfloat16)
    return (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)


def random_checkpoint(dst: Path, text_config: dict[str, Any], seed: int = 0) -> int:
    """Write the checkpoint directory (reused when present); returns the parameter count."""
    shapes = tensor_shapes(text_config)
    n_params = sum(math.prod(s) for s in shapes.values())
    if (dst / "config.json").exists():
        base.log(f"reusing random checkpoint {dst}")
        return n_params
    base.log(f"writing random Qwen 3.5 checkpoint ({n_params / 1e9:.3f}B params, bf16) to {dst}")
    dst.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    tensors = {name: _random_tensor(name, shape) for name, shape in shapes.items()}
    mx.eval(tensors)
    mx.save_safetensors(str(dst / "model.safetensors"), tensors, metadata={"format": "pt"})
    del tensors
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": False,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    write_word_tokenizer(dst, text_config["vocab_size"])
    return n_params




# ---------------------------------------------------------------- runtimes




_ZERO_CENTERED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".norm.weight", "_norm.weight")


def float32_check(install: Path, model_dir: Path, ids: list[int]) -> str:
    """Prompt logits of turbospark vs mlx-lm with float32 weights (a correctness check at scale).

    mlx-lm's sanitize adds the 1 of the (1 + w) norms in bf16; the check
    reloads those norms as ``1 + w`` computed in float32, as the reference does.
    """
    import mlx_lm
    from mlx.utils import tree_map

    ts = turbospark_core.open(install, max_context=len(ids) + 8).logits(ids)
    base.release()
    model, _ = mlx_lm.load(str(model_dir))
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    norms = [
        (name.replace("model.language_model.", "language_model.model."), 1.0 + w.astype(mx.float32))
        for name, w in mx.load(str(model_dir / "model.safetensors")).items()
        if name.endswith(_ZERO_CENTERED) and "linear_attn" not in name
    ]
    model.load_weights(norms, strict=False)
    ml = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    del model
    base.release()
    rel = float(np.abs(ts - ml).max() / np.abs(ml).max())
    agree = float((ts.argmax(-1) == ml.argmax(-1)).mean())
    return (
        f"float32 check: prompt logits max rel diff {rel:.1e}, argmax agreement {agree:.1%} over {len(ids)} positions"
    )


# ---------------------------------------------------------------- recurrence alone
def bench_recurrence(c: dict[str, Any], lengths: list[int], repeats: int = 3) -> list[list[str]]:
    """Chunked prefill vs the token-by-token compiled step, at the model's DeltaNet shapes."""
    from turbospark_qwen import gated_delta as gd

    H, Dk, Dv = c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
    rows = [["tokens", "chunked (ms)", "token-by-token (ms)", "speedup", "max rel diff"]]
    for L in lengths:
        q, k = (gd.l2_normalize(mx.random.normal((1, H, L, Dk))) for _ in range(2))
        v = mx.random.normal((1, H, L, Dv))
        g = -mx.random.uniform(0.01, 2.0, (1, H, L))
        beta = mx.sigmoid(mx.random.normal((1, H, L)))
        state = mx.zeros((1, H, Dk, Dv))
        args = (q * Dk**-0.5, k, v, g, beta, state)
        mx.eval(args)
        times, outs = {}, {}
        for name, fn in (("chunked", gd.chunked), ("step", gd.recurrent)):
            outs[name] = fn(*args)[0]
            mx.eval(outs[name])
            t0 = time.perf_counter()
            for _ in range(repeats):
                mx.eval(fn(*args))
            times[name] = (time.perf_counter() - t0) / repeats * 1e3
        diff = float(mx.abs(outs["chunked"] - outs["step"]).max() / mx.abs(outs["step"]).max())
        rows.append([str(L), f"{times['chunked']:.1f}", f"{times['step']:.1f}",
                     f"{times['step'] / times['chunked']:.2f}x", f"{diff:.1e}"])
    return rows



def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, prompt_tokens=128, gen_tokens=32)
    ap.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    ap.add_argument("--recurrence", action="store_true", help="also time the gated delta rule alone")
    ap.add_argument("--f32-check", action="store_true", help="also compare prompt logits with mlx-lm in float32")
    args = parse(ap, argv)
    with workdir(args.workdir, "turbospark-qwen-bench-") as work:
        return compare(args, work)


def compare(args: argparse.Namespace, work: Path) -> int:
    base.log(f"workdir {work}; MLX {mx.__version__} on {mx.default_device()}")
    c = SIZES[args.size]
    ckpt, install = work / f"qwen3_5-{args.size}.hf", work / f"qwen3_5-{args.size}.turbospark"
    n_params = random_checkpoint(ckpt, c)
    base.convert_install(ckpt, install)
    ids = np.random.default_rng(1).integers(3, c["vocab_size"], size=args.prompt_tokens).tolist()
    result: dict[str, Any] = {
        "label": f"random qwen3_5 {n_params / 1e9:.2f}B bf16",
        "prompt_tokens": len(ids),
        "note": "random weights give near-tied logits; turbospark computes in float32 on the CPU, mlx-lm in bf16",
    }
    base.log("== turbospark")
    result["turbospark"] = base.run_worker("turbospark", install, ids, args.gen_tokens, work)
    base.log("== mlx-lm")
    result["mlx-lm"] = base.run_worker("mlx-lm", ckpt, ids, args.gen_tokens, work)
    print(f"prompt {len(ids)} tokens, {args.gen_tokens} generated; MLX {mx.__version__} on {mx.default_device()}")
    print(base.report([result], None))
    if args.f32_check:
        print(float32_check(install, ckpt, ids))
    if args.recurrence:
        print("\ngated delta rule alone (B=1, float32):")
        print(base.render(bench_recurrence(c, [16, 64, args.prompt_tokens, 512])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
