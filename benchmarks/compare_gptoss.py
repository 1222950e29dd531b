#!/usr/bin/env python
"""turbospark vs mlx-lm on a random gpt-oss-shaped model, side by side.

The script writes a random-weight gpt-oss checkpoint in the released Hugging
Face layout (fused, transposed ``mlp.experts.gate_up_proj`` with interleaved
gate/up columns, ``down_proj``, per-projection biases, attention sinks, YaRN
rope with ``truncate: false``, alternating sliding/full layers), converts it
with ``turbospark_core.convert.convert``, and runs both runtimes on the same
prompt ids: open time, prompt tok/s, generation tok/s and peak memory, plus
the ratios (the table and measurement code come from ``compare_mlx_lm.py``).

Formats (``--formats``):

* ``bf16``: every tensor bf16 (random normal * 0.02). turbospark converts the
  checkpoint and, on the CPU, unpacks it to float32. mlx-lm cannot run it as
  is: its ``sanitize`` does not transpose bf16/float ``gate_up_proj`` (the
  load fails with "parameters not in model"), and its bf16 MoE fails on the
  CPU anyway (``gather_mm`` is float32-only there). So mlx-lm gets a float32
  copy of the same weights in its own layout (``experts.{gate,up,down}_proj``).
* ``mxfp4``: the experts are MXFP4 ``*_blocks``/``*_scales`` as in the
  released checkpoints (the rest bf16). Both runtimes read the same directory:
  turbospark converts the blocks bit for bit to MLX mxfp4 and (CPU policy)
  unpacks them to float32; mlx-lm keeps mxfp4 + bf16 and runs quantized kernels.

mlx-lm is a benchmark-only dependency: turbospark itself never imports it.

Usage::

    python benchmarks/compare_gptoss.py [--prompt-tokens 256] [--gen-tokens 64]
        [--formats bf16,mxfp4] [--layers 8] [--hidden 512] [--experts 16] [--workdir DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import arguments, parse, workdir, write_word_tokenizer
from compare_mlx_lm import (  # the sibling benchmark's measurement helpers
    agreement,
    bench_mlx_lm,
    bench_turbospark,
    convert_install,
    log,
    measure_bandwidth,
    random_prompt_ids,
    report,
)

VOCAB = 32000


def gpt_oss_config(layers: int, hidden: int, experts: int) -> dict[str, Any]:
    """A gpt-oss ``config.json`` of the given size (head_dim 64, top-4 routing, window 128)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": hidden,
        "intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
        "vocab_size": VOCAB,
        "num_local_experts": experts,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def _normal(shape: tuple[int, ...]) -> mx.array:
    return (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)


def random_weights(c: dict[str, Any]) -> dict[str, mx.array]:
    """Released-layout gpt-oss tensors (experts fused and transposed), bf16 normal * 0.02."""
    h, inter, n_exp = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    q_out, kv_out = c["num_attention_heads"] * 64, c["num_key_value_heads"] * 64
    w = {
        "model.embed_tokens.weight": _normal((VOCAB, h)),
        "lm_head.weight": _normal((VOCAB, h)),
        "model.norm.weight": mx.ones((h,), mx.bfloat16),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w |= {
            f"{p}.input_layernorm.weight": mx.ones((h,), mx.bfloat16),
            f"{p}.post_attention_layernorm.weight": mx.ones((h,), mx.bfloat16),
            f"{p}.self_attn.sinks": _normal((c["num_attention_heads"],)),
            f"{p}.mlp.router.weight": _normal((n_exp, h)),
            f"{p}.mlp.router.bias": _normal((n_exp,)),
            f"{p}.mlp.experts.gate_up_proj": _normal((n_exp, h, 2 * inter)),
            f"{p}.mlp.experts.gate_up_proj_bias": _normal((n_exp, 2 * inter)),
            f"{p}.mlp.experts.down_proj": _normal((n_exp, inter, h)),
            f"{p}.mlp.experts.down_proj_bias": _normal((n_exp, h)),
        }
        for proj, (out, inp) in {
            "q_proj": (q_out, h),
            "k_proj": (kv_out, h),
            "v_proj": (kv_out, h),
            "o_proj": (h, q_out),
        }.items():
            w[f"{p}.self_attn.{proj}.weight"] = _normal((out, inp))
            w[f"{p}.self_attn.{proj}.bias"] = _normal((out,))
    return w


def as_mxfp4_blocks(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """Replace each fused expert matrix ``[E, in, out]`` by released MXFP4 ``_blocks``/``_scales``."""
    out = {}
    for name, arr in w.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[name] = arr
            continue
        q, scales = mx.quantize(mx.swapaxes(arr, -1, -2).astype(mx.float32), mode="mxfp4")
        E, rows, words = q.shape
        out[f"{name}_blocks"] = mx.view(q, mx.uint8).reshape(E, rows, words // 4, 16)
        out[f"{name}_scales"] = scales
    return out


def param_count(c: dict[str, Any]) -> int:
    """Parameters of :func:`random_weights` (dequantized)."""
    h, inter, n_exp = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    q_out, kv_out = c["num_attention_heads"] * 64, c["num_key_value_heads"] * 64
    attn = (q_out * h + q_out) + 2 * (kv_out * h + kv_out) + (h * q_out + h) + c["num_attention_heads"]
    experts = n_exp * (3 * h * inter + 2 * inter + h)
    per_layer = 2 * h + attn + n_exp * (h + 1) + experts
    return 2 * VOCAB * h + h + c["num_hidden_layers"] * per_layer


def write_checkpoint(dst: Path, config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    write_word_tokenizer(dst, VOCAB)


def mlx_lm_float32_layout(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """The same weights in mlx-lm's own gpt_oss layout, float32 (its CPU MoE is float32-only)."""
    out = {}
    for name, arr in w.items():
        arr = arr.astype(mx.float32)
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            t = mx.swapaxes(arr, -1, -2)
            out[f"{prefix}.gate_proj.weight"], out[f"{prefix}.up_proj.weight"] = t[:, 0::2], t[:, 1::2]
        elif leaf == "gate_up_proj_bias":
            out[f"{prefix}.gate_proj.bias"], out[f"{prefix}.up_proj.bias"] = arr[:, 0::2], arr[:, 1::2]
        elif leaf == "down_proj":
            out[f"{prefix}.down_proj.weight"] = mx.swapaxes(arr, -1, -2)
        elif leaf == "down_proj_bias":
            out[f"{prefix}.down_proj.bias"] = arr
        else:
            out[name] = arr
    return out


def prepare(work: Path, fmt: str, config: dict[str, Any], n_prompt: int) -> dict[str, Any]:
    """Write the checkpoint (and mlx-lm's copy for bf16), convert it; returns what to run."""
    ckpt, install = work / f"gptoss-{fmt}.hf", work / f"gptoss-{fmt}.turbospark"
    mlx_dir = ckpt if fmt == "mxfp4" else work / f"gptoss-{fmt}.mlx-lm-float32"
    if not (ckpt / "config.json").exists():
        mx.random.seed(0)
        weights = random_weights(config)
        mx.eval(weights)
        if fmt == "mxfp4":
            config = {**config, "quantization_config": {"quant_method": "mxfp4"}}
            weights = as_mxfp4_blocks(weights)
        else:
            write_checkpoint(mlx_dir, config, mlx_lm_float32_layout(weights))
        write_checkpoint(ckpt, config, weights)
        log(f"wrote {fmt} checkpoint {ckpt}")
    convert_install(ckpt, install)
    n_params = param_count(config)
    note = (
        "mlx-lm ran a float32 copy in its own layout: it cannot load bf16 fused gpt-oss experts and its bf16 "
        "MoE fails on the CPU (gather_mm is float32-only); turbospark ran the bf16 install (CPU policy: float32)"
        if fmt == "bf16"
        else "same MXFP4 directory for both: mlx-lm keeps mxfp4 experts + bf16 (quantized kernels); "
        "turbospark converts bit for bit and, on the CPU, unpacks to float32"
    )
    return {
        "label": f"gpt-oss {n_params / 1e6:.0f}M {config['num_hidden_layers']}L/{config['num_local_experts']}E {fmt}",
        "install": install,
        "mlx_dir": mlx_dir,
        "ids": random_prompt_ids(VOCAB, n_prompt),
        "note": note + "; random weights: greedy agreement is informative only for the first tokens",
    }


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, prompt_tokens=256, gen_tokens=64)
    ap.add_argument("--formats", default="bf16,mxfp4", help="comma list of: bf16, mxfp4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512, help="hidden = intermediate size (a multiple of 64)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth-bound column")
    args = parse(ap, argv)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats or any(f not in ("bf16", "mxfp4") for f in formats):
        ap.error(f"--formats {args.formats!r}: choose from bf16, mxfp4")
    if args.hidden % 64 or args.experts < 4:
        ap.error("--hidden must be a multiple of 64 and --experts at least 4 (top-4 routing)")
    with workdir(args.workdir, "turbospark-gptoss-") as work:
        return compare(args, formats, work)


def compare(args: argparse.Namespace, formats: list[str], work: Path) -> int:
    config = gpt_oss_config(args.layers, args.hidden, args.experts)
    log(f"workdir {work}; MLX {mx.__version__} on {mx.default_device()}")
    results = []
    for fmt in formats:
        prep = prepare(work, fmt, config, args.prompt_tokens)
        res: dict[str, Any] = {"label": prep["label"], "prompt_tokens": len(prep["ids"]), "note": prep["note"]}
        log(f"== {fmt}: turbospark")
        res["turbospark"] = bench_turbospark(prep["install"], prep["ids"], args.gen_tokens)
        log(f"== {fmt}: mlx-lm")
        res["mlx-lm"] = bench_mlx_lm(prep["mlx_dir"], prep["ids"], args.gen_tokens)
        log(f"   greedy tokens agree {agreement(res['turbospark']['tokens'], res['mlx-lm']['tokens'])}")
        results.append(res)
    bandwidth = None if args.no_bandwidth else measure_bandwidth()
    print(
        f"turbospark vs mlx-lm, gpt-oss  ({time.strftime('%Y-%m-%d')}, MLX {mx.__version__}, "
        f"device {mx.default_device()}, prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated, greedy)"
    )
    print(report(results, bandwidth))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
