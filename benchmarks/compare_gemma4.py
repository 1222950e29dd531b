#!/usr/bin/env python
"""turbospark vs mlx-lm on a random Gemma 4-shaped model, side by side on the same weights.

The script writes a Hugging Face ``gemma4`` checkpoint directory with random
bf16 weights (normal * 0.02; norms, layer scalars and router scales are ones),
converts it with ``turbospark_core.convert.convert``, loads the same directory
with ``mlx_lm.load``, and for each runtime in turn: opens the model (timed),
warms up, and runs one greedy generation of ``--gen-tokens`` tokens on the same
``--prompt-tokens`` random prompt ids. It prints prompt tok/s, generation
tok/s, peak memory and open time for both, and the ratios.

Models (``--models``):

* ``e``: the E2B/E4B shape scaled down: per-layer input embeddings (PLE),
  KV sharing over the last layers (double-wide MLP there), sliding layers with
  head_dim 256 and full layers with head_dim 512 and proportional partial RoPE,
  five sliding layers per full one, final logit softcapping.
* ``moe``: the 26B-A4B shape scaled down: a routed-expert block beside the
  dense MLP, K = V on the full layers (one global KV head).

Each runtime runs in its own child process (``compare_mlx_lm.run_worker``),
with the BLAS it gets in normal use (``--mlx-lm-openblas`` gives mlx-lm
turbospark's OpenBLAS shim too). On the CPU, mlx-lm loads a float32 copy of
the MoE checkpoint: MLX's CPU ``gather_mm`` (its experts) is float32-only.

The sliding window is 128 tokens (released models: 512-1024) so that the
default 256-token prompt already runs the ring buffer past its window.

mlx-lm 0.32.2 reads the vocabulary size of a ``gemma4`` config from its top
level, not from ``text_config`` (transformers' place for it), so the config
written here carries it in both places. mlx-lm is a benchmark-only dependency.

Usage::

    python benchmarks/compare_gemma4.py [--prompt-tokens 256] [--gen-tokens 64]
        [--models e,moe] [--workdir DIR] [--f32-check] [--mlx-lm-openblas]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import turbospark_core  # noqa: F401  (first: its BLAS shim binds before mlx loads, as in normal use)  # isort: skip

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_mlx_lm as base  # (shared child-process runners and report)
from common import arguments, parse, workdir, write_word_tokenizer

SLIDING, FULL = "sliding_attention", "full_attention"

_COMMON: dict[str, Any] = {
    "model_type": "gemma4_text",
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "hidden_activation": "gelu_pytorch_tanh",
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "sliding_window": 128,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

TEXT_CONFIGS: dict[str, dict[str, Any]] = {
    "e": {
        **_COMMON,
        "num_hidden_layers": 12,
        "layer_types": ([SLIDING] * 5 + [FULL]) * 2,
        "intermediate_size": 4096,
        "num_key_value_heads": 1,
        "num_global_key_value_heads": None,
        "hidden_size_per_layer_input": 128,
        "vocab_size_per_layer_input": 32000,
        "num_kv_shared_layers": 4,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
    },
    "moe": {
        **_COMMON,
        "num_hidden_layers": 6,
        "layer_types": [SLIDING] * 5 + [FULL],
        "intermediate_size": 1024,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 32000,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "attention_k_eq_v": True,
        "enable_moe_block": True,
        "num_experts": 32,
        "top_k_experts": 4,
        "moe_intermediate_size": 512,
    },
}


def _attention_shapes(c: dict[str, Any], i: int, p: str) -> dict[str, tuple[int, ...]]:
    full = c["layer_types"][i] == FULL
    hd = c["global_head_dim"] if full else c["head_dim"]
    k_eq_v = full and c["attention_k_eq_v"]
    kv = c["num_global_key_value_heads"] if k_eq_v and c["num_global_key_value_heads"] else c["num_key_value_heads"]
    h, q = c["hidden_size"], c["num_attention_heads"] * hd
    # KV-shared layers still carry k/v tensors in released checkpoints (never read)
    shapes = {
        f"{p}.self_attn.q_proj.weight": (q, h),
        f"{p}.self_attn.o_proj.weight": (h, q),
        f"{p}.self_attn.q_norm.weight": (hd,),
        f"{p}.self_attn.k_norm.weight": (hd,),
        f"{p}.self_attn.k_proj.weight": (kv * hd, h),
    }
    if not k_eq_v:
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv * hd, h)
    return shapes


def _layer_shapes(c: dict[str, Any], i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.language_model.layers.{i}"
    h = c["hidden_size"]
    shared = i >= c["num_hidden_layers"] - c["num_kv_shared_layers"]
    inter = c["intermediate_size"] * (2 if shared and c["use_double_wide_mlp"] else 1)
    shapes = _attention_shapes(c, i, p) | {
        f"{p}.mlp.gate_proj.weight": (inter, h),
        f"{p}.mlp.up_proj.weight": (inter, h),
        f"{p}.mlp.down_proj.weight": (h, inter),
        f"{p}.layer_scalar": (1,),
    }
    norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if c["enable_moe_block"]:
        e, mi = c["num_experts"], c["moe_intermediate_size"]
        norms += ["pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2"]
        shapes |= {
            f"{p}.router.proj.weight": (e, h),
            f"{p}.router.scale": (h,),
            f"{p}.router.per_expert_scale": (e,),
            f"{p}.experts.gate_up_proj": (e, 2 * mi, h),
            f"{p}.experts.down_proj": (e, h, mi),
        }
    if c["hidden_size_per_layer_input"]:
        ple = c["hidden_size_per_layer_input"]
        norms.append("post_per_layer_input_norm")
        shapes |= {f"{p}.per_layer_input_gate.weight": (ple, h), f"{p}.per_layer_projection.weight": (h, ple)}
    return shapes | {f"{p}.{n}.weight": (h,) for n in norms}


def checkpoint_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Gemma4ForConditionalGeneration text checkpoint (no vision tower)."""
    h, n = c["hidden_size"], c["num_hidden_layers"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.language_model.embed_tokens.weight": (c["vocab_size"], h),
        "model.language_model.norm.weight": (h,),
    }
    if c["hidden_size_per_layer_input"]:
        ple = c["hidden_size_per_layer_input"]
        shapes |= {
            "model.language_model.embed_tokens_per_layer.weight": (c["vocab_size_per_layer_input"], n * ple),
            "model.language_model.per_layer_model_projection.weight": (n * ple, h),
            "model.language_model.per_layer_projection_norm.weight": (ple,),
        }
    for i in range(n):
        shapes |= _layer_shapes(c, i)
    return shapes


def random_gemma4_checkpoint(dst: Path, text_config: dict[str, Any], seed: int = 0) -> int:
    """A Hugging Face gemma4 checkpoint dir with random bf16 weights; returns #params."""
    shapes = checkpoint_shapes(text_config)
    n_params = sum(math.prod(s) for s in shapes.values())
    if (dst / "config.json").exists():
        base.log(f"reusing random checkpoint {dst}")
        return n_params
    base.log(f"writing random gemma4 checkpoint ({n_params / 1e9:.3f}B params, bf16) to {dst}")
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
    del tensors
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": text_config,
        "vocab_size": text_config["vocab_size"],  # where mlx-lm 0.32.2 looks for it
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    write_word_tokenizer(dst, text_config["vocab_size"])
    return n_params


def float32_copy(src: Path, dst: Path) -> None:
    """The checkpoint with float32 tensors: MLX's CPU ``gather_mm`` (mlx-lm's experts) is float32-only."""
    if (dst / "config.json").exists():
        base.log(f"reusing float32 copy {dst}")
        return
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.astype(mx.float32) for k, v in mx.load(str(src / "model.safetensors")).items()}
    mx.save_safetensors(str(dst / "model.safetensors"), tensors, metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    base.log(f"wrote float32 copy {dst} for mlx-lm's CPU experts")


def prepare(work: Path, name: str, n_prompt: int) -> dict[str, Any]:
    c = TEXT_CONFIGS[name]
    ckpt = work / f"random-gemma4-{name}.hf"
    install = work / f"random-gemma4-{name}.turbospark"
    n_params = random_gemma4_checkpoint(ckpt, c)
    base.convert_install(ckpt, install)
    kinds = {"e": "PLE + KV sharing", "moe": f"MoE {c.get('top_k_experts')}/{c.get('num_experts')} + K=V"}[name]
    mlx_dir, note = ckpt, ""
    if c["enable_moe_block"] and mx.default_device() == mx.cpu:
        mlx_dir = work / f"random-gemma4-{name}.f32.hf"
        float32_copy(ckpt, mlx_dir)
        note = "mlx-lm loads a float32 copy (its CPU experts need float32); "
    return {
        "label": f"random gemma4-{name} {n_params / 1e9:.2f}B bf16 ({kinds})",
        "install": install,
        "mlx_dir": mlx_dir,
        "ids": base.random_prompt_ids(c["vocab_size"], n_prompt),
        "note": (
            f"{note}{c['num_hidden_layers']} layers, window {c['sliding_window']}; random weights: "
            "greedy ties make token agreement informative only for the first few tokens"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, prompt_tokens=256, gen_tokens=64)
    ap.add_argument("--models", default="e,moe", help="comma list of: " + ", ".join(TEXT_CONFIGS))
    ap.add_argument("--f32-check", action="store_true", help="also take mlx-lm's first greedy token in float32")
    ap.add_argument(
        "--mlx-lm-openblas",
        action="store_true",
        help="run mlx-lm with turbospark's OpenBLAS shim loaded too (default: MLX's own BLAS, as mlx-lm users get)",
    )
    args = parse(ap, argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in TEXT_CONFIGS for m in models):
        ap.error(f"--models must be a comma list of {', '.join(TEXT_CONFIGS)}")
    with workdir(args.workdir, "turbospark-gemma4-bench-") as work:
        return compare(args, models, work)


def compare(args: argparse.Namespace, models: list[str], work: Path) -> int:
    base.log(f"workdir {work}; MLX {mx.__version__} on {mx.default_device()}")
    results = []
    for name in models:
        prep = prepare(work, name, args.prompt_tokens)
        res: dict[str, Any] = {"label": prep["label"], "prompt_tokens": len(prep["ids"]), "note": prep["note"]}
        base.log(f"== {name}: turbospark")
        res["turbospark"] = base.run_worker("turbospark", prep["install"], prep["ids"], args.gen_tokens, work)
        base.log(f"== {name}: mlx-lm")
        res["mlx-lm"] = base.run_worker(
            "mlx-lm", prep["mlx_dir"], prep["ids"], args.gen_tokens, work,
            f32_check=args.f32_check, openblas=args.mlx_lm_openblas,
        )
        results.append(res)
    print(
        f"turbospark vs mlx-lm, Gemma 4 shapes ({time.strftime('%Y-%m-%d')}, MLX {mx.__version__}, "
        f"device {mx.default_device()}, prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated, greedy)"
    )
    print(base.report(results, None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
