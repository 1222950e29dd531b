#!/usr/bin/env python
"""turbospark vs mlx-lm on a random DeepSeek-V2-Lite-shaped model, and the latent cache's size.

The script writes a Hugging Face checkpoint directory (``model_type``
``deepseek_v2``, V2-Lite's attention exactly: hidden 2048, 16 heads,
``q_lora_rank`` null, ``kv_lora_rank`` 512, rope 64 / nope 128 / v 128, YaRN
as released; DeepSeekMoE with 2 shared experts and top-6 routing; bf16 random
normal * 0.02, norms 1), converts it with ``turbospark_core.convert.convert``
and gives mlx-lm a float32 copy of the same values (its CPU MoE, ``gather_mm``,
is float32-only; turbospark computes in float32 on the CPU too). Each runtime runs in its
own process: open (timed), warm up, reset the peak-memory counter, one greedy
generation on the same prompt ids; the report gives prompt tok/s, generation
tok/s, peak memory and open time, and the ratios.

Then the KV cache: bytes per token (all layers) of turbospark's compressed MLA
cache (one ``[c | k_r]`` row: kv_lora_rank + qk_rope_head_dim values per token
and layer), as its memory estimate counts it for an open at 4k and 32k
context, against an uncompressed cache of per-head keys and values
(H * (qk_nope + qk_rope + v) values, what mlx-lm's deepseek_v2 holds), in the
same dtype; and the bytes each runtime's cache actually holds after the prompt.

Sizes (fewer layers than the real 27, fewer experts unless ``lite``):
``small`` (default: 3 layers, 1 dense + 2 MoE of 16 routed experts, 32k vocab,
0.55B params) and ``lite`` (4 layers, 64 routed experts of V2-Lite's width,
its 102400 vocab, 2.1B params: needs ~13 GB).

mlx-lm is a benchmark-only dependency: turbospark itself never imports it.

Usage::

    python benchmarks/deepseek.py [--size small|lite] [--prompt-tokens 128]
        [--gen-tokens 32] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import turbospark_core  # first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_mlx_lm as base  # (shared child-process runners and report)
from common import arguments, parse, workdir, write_word_tokenizer

_LITE: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "n_shared_experts": 2,
    "num_experts_per_tok": 6,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "max_position_embeddings": 163840,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SIZES: dict[str, dict[str, Any]] = {
    "small": {**_LITE, "num_hidden_layers": 3, "n_routed_experts": 16, "vocab_size": 32000},
    "lite": {**_LITE, "num_hidden_layers": 4, "n_routed_experts": 64, "vocab_size": 102400},
}
CONTEXTS = (4096, 32768)


# ---------------------------------------------------------------- checkpoint
def tensor_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Hugging Face DeepSeek-V2 checkpoint of config ``c`` (V2-Lite: plain q_proj)."""
    h, H, r, dr = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    dn, dv, mi = c["qk_nope_head_dim"], c["v_head_dim"], c["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c["vocab_size"], h),
    }

    def mlp(prefix: str, width: int) -> dict[str, tuple[int, ...]]:
        return {
            f"{prefix}.gate_proj.weight": (width, h),
            f"{prefix}.up_proj.weight": (width, h),
            f"{prefix}.down_proj.weight": (h, width),
        }

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (H * (dn + dr), h),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (r + dr, h),
            f"{p}.self_attn.kv_a_layernorm.weight": (r,),
            f"{p}.self_attn.kv_b_proj.weight": (H * (dn + dv), r),
            f"{p}.self_attn.o_proj.weight": (h, H * dv),
        }
        if i < c["first_k_dense_replace"]:
            shapes |= mlp(f"{p}.mlp", c["intermediate_size"])
            continue
        shapes[f"{p}.mlp.gate.weight"] = (c["n_routed_experts"], h)
        shapes |= mlp(f"{p}.mlp.shared_experts", mi * c["n_shared_experts"])
        for e in range(c["n_routed_experts"]):
            shapes |= mlp(f"{p}.mlp.experts.{e}", mi)
    return shapes


def float32_copy(src: Path, dst: Path) -> None:
    """The checkpoint with every tensor widened to float32 (exact), for mlx-lm's float32-only CPU MoE."""
    if (dst / "config.json").exists():
        return
    dst.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(src / "model.safetensors")).items()}
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    del weights
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


def random_checkpoint(dst: Path, c: dict[str, Any], seed: int = 0) -> int:
    """Write the checkpoint directory (reused when present); returns the parameter count."""
    shapes = tensor_shapes(c)
    n_params = sum(math.prod(s) for s in shapes.values())
    if (dst / "config.json").exists():
        base.log(f"reusing random checkpoint {dst}")
        return n_params
    base.log(f"writing random DeepSeek-V2-Lite-shaped checkpoint ({n_params / 1e9:.3f}B params, bf16) to {dst}")
    dst.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    tensors = {
        name: mx.ones(shape, mx.bfloat16) if len(shape) == 1 else (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)
        for name, shape in shapes.items()
    }
    mx.eval(tensors)
    mx.save_safetensors(str(dst / "model.safetensors"), tensors, metadata={"format": "pt"})
    del tensors
    (dst / "config.json").write_text(json.dumps(c, indent=1))
    write_word_tokenizer(dst, c["vocab_size"])
    return n_params


# ---------------------------------------------------------------- KV cache size
def kv_table(install: Path, c: dict[str, Any]) -> list[list[str]]:
    """Bytes per token and totals at 4k / 32k: turbospark's estimate against an uncompressed cache."""
    rows = [["context", "turbospark MLA cache", "uncompressed K/V (same dtype)", "ratio", "per token"]]
    layers, H = c["num_hidden_layers"], c["num_attention_heads"]
    for ctx in CONTEXTS:
        runner = turbospark_core.open(install, max_context=ctx)  # the KV estimate; caches grow lazily
        kv = runner.opened.estimate.kv
        itemsize = kv / (ctx * layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]))
        full = ctx * layers * H * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * itemsize
        rows.append(
            [
                f"{ctx // 1024}k",
                f"{kv / 2**20:.1f} MiB",
                f"{full / 2**20:.1f} MiB",
                f"{full / kv:.1f}x smaller",
                f"{kv / ctx / 1024:.1f} KiB vs {full / ctx / 1024:.1f} KiB ({itemsize:.0f}-byte values)",
            ]
        )
        del runner
        base.release()
    return rows


def held_after_prompt(install: Path, ckpt: Path, ids: list[int]) -> str:
    """The bytes each runtime's cache holds after one prompt (allocation steps included)."""
    runner = turbospark_core.open(install, max_context=CONTEXTS[0])  # grows in steps of 256, as mlx-lm's
    cache = runner.opened.new_cache()
    mx.eval(runner.model(mx.array([ids]), cache))
    ts = sum(a.nbytes for c in cache for a in c.state)
    del runner, cache
    base.release()
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(str(ckpt))
    mcache = make_prompt_cache(model)
    mx.eval(model(mx.array([ids]), cache=mcache))
    ml = sum(a.nbytes for c in mcache for a in (c.keys, c.values) if a is not None)
    del model, mcache
    base.release()
    return (
        f"cache held after the {len(ids)}-token prompt: turbospark {ts / 2**20:.2f} MiB, "
        f"mlx-lm {ml / 2**20:.2f} MiB ({ml / ts:.1f}x; both allocate in steps of 256 tokens, "
        f"both float32 here)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, prompt_tokens=128, gen_tokens=32)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    args = parse(ap, argv)
    with workdir(args.workdir, "turbospark-deepseek-bench-") as work:
        return compare(args, work)


def compare(args: argparse.Namespace, work: Path) -> int:
    base.log(f"workdir {work}; MLX {mx.__version__} on {mx.default_device()}")
    c = SIZES[args.size]
    ckpt, install = work / f"deepseek_v2-{args.size}.hf", work / f"deepseek_v2-{args.size}.turbospark"
    n_params = random_checkpoint(ckpt, c)
    base.convert_install(ckpt, install)
    f32 = work / f"deepseek_v2-{args.size}.mlx-lm-float32"
    float32_copy(ckpt, f32)
    ids = np.random.default_rng(1).integers(3, c["vocab_size"], size=args.prompt_tokens).tolist()
    result: dict[str, Any] = {
        "label": f"random deepseek_v2 {n_params / 1e9:.2f}B bf16",
        "prompt_tokens": len(ids),
        "note": "random weights give near-tied logits; mlx-lm ran a float32 copy (its CPU gather_mm is float32-only)",
    }
    base.log("== turbospark")
    result["turbospark"] = base.run_worker("turbospark", install, ids, args.gen_tokens, work)
    base.log("== mlx-lm")
    result["mlx-lm"] = base.run_worker("mlx-lm", f32, ids, args.gen_tokens, work)
    print(f"prompt {len(ids)} tokens, {args.gen_tokens} generated; MLX {mx.__version__} on {mx.default_device()}")
    print(base.report([result], None))
    print(f"\nKV cache, {c['num_hidden_layers']} layers (estimate at open):")
    print(base.render(kv_table(install, c)))
    print(held_after_prompt(install, f32, ids))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
