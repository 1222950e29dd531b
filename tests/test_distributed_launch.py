"""Two ranks under ``mlx.launch`` (ring backend, loopback): tensor and pipeline parallelism against one process.

Each test is one launch (every rank imports mlx once), running many checks:
``tests/distributed_worker.py`` writes what each rank got, these tests compare
it with the single-process runs of the same installs (at least one of every
family's), each for its prompt's logits, the logits of one-token steps after it
(the cached decode path) and greedy tokens. Tensor parallelism sums partial
products in another order, so its logits are held within 1e-5 of the
single process's (relative to max(1, max|logit|), float32); pipeline ranks run
exactly the single process's operations, so its logits are equal bit for bit.
Greedy tokens are identical in both.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core.steering import DirectionSet
from turbospark_core.testing import llama_tensor_shapes


def _module(path: Path) -> Any:
    """A helper module of this repository's tests, loaded from its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROOT = Path(__file__).parents[1]
WORKER = Path(__file__).with_name("distributed_worker.py")
worker = _module(WORKER)
tiny_v3 = _module(ROOT / "plugins/deepseek/tests/tiny_v3.py")
tiny_gemma3 = _module(ROOT / "examples/turbospark-gemma3/tests/tiny_gemma3.py")
LAUNCH_TIMEOUT_S = 600
RANKS = 2
TOLERANCE = 1e-5

FIXTURES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3_5": {},
    "gemma4_e": {},
    "gpt_oss": {},
    "qwen3_5_moe": {"residency": "streamed", "expert_slots": 2},  # streamed experts under expert parallelism
    "qwen3_5_mtp": {"mtp": 2, "num_draft_tokens": 2},
    "spark2_5": {},  # fused q|k|v, head-wise output gate
    "deepseek_v2": {},  # latent attention: expanded prefill, absorbed decode; shared and routed experts
    "deepseek_v2_qlora": {},  # low-rank queries, v_head_dim != qk_nope_head_dim, group-limited routing
    "deepseek_v3": {},  # tiny random (below): sigmoid + bias noaux_tc routing
    "gemma3": {},  # the example plugin's tiny config: q/k norms, sliding layers, GeGLU
}
TINY = {  # tiny random installs (no shared fixture): config, tensor shapes
    "deepseek_v3": (tiny_v3.V3, tiny_v3.v3_tensors(tiny_v3.V3)),
    "gemma3": (
        tiny_gemma3.TINY_CONFIG,
        {name: w.shape for name, w in tiny_gemma3.random_weights(tiny_gemma3.TINY_CONFIG, 0).items()},
    ),
}
DUMMY = {"model_type": "dummy_lm", "hidden_size": 16, "vocab_size": 32}  # the test plugin's family: no plan
DUMMY_TENSORS = {"model.embed_tokens.weight": (32, 16), "lm_head.weight": (32, 16)}
INDIVISIBLE = {  # three query and key/value heads: two ranks cannot split them
    "model_type": "llama",
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 64,
    "tie_word_embeddings": True,
}


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on loopback now."""
    for _ in range(100):
        base = random.randint(20000, 60000 - count)
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError("no free consecutive ports on 127.0.0.1")


def _launcher() -> list[str]:
    launch = Path(sys.executable).with_name("mlx.launch")
    assert launch.exists(), f"{launch} is missing; mlx installs it with its Python package"
    ports = _free_ports(RANKS)
    return [
        str(launch),
        "-n",
        str(RANKS),
        "--backend",
        "ring",
        "--starting-port",
        str(ports),
        "--python",
        sys.executable,
    ]


@contextlib.contextmanager
def launched(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``mlx.launch ... command`` in its own process group, killed with its ranks when the block ends."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*_launcher(), "--", *command], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _run(job: dict[str, Any], tmp_path: Path) -> list[dict[str, Any]]:
    (tmp_path / "job.json").write_text(json.dumps(job))
    log = tmp_path / "launch.log"
    for _ in range(2):  # a port taken between the check and the ranks' bind: once more, on other ports
        with launched([str(WORKER), str(tmp_path / "job.json")], log) as proc:
            try:
                rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the launch ran past {LAUNCH_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
        if rc == 0 or "Couldn't bind" not in log.read_text():
            break
    assert rc == 0, log.read_text()[-4000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(RANKS)]


def _prompt(fixtures: Path, name: str) -> list[int]:
    if name in TINY:  # 48 tokens, as the fixtures' prompts
        return np.random.default_rng(5).integers(3, TINY[name][0]["vocab_size"], size=48).tolist()
    return [int(i) for i in np.load(fixtures / name / "references.npz")["prompt_ids"]]


@pytest.fixture(scope="module")
def installs(
    turbospark_install: Callable[..., Path],
    turbospark_tiny_install: Callable[..., Path],
    turbospark_fixtures: Path,
) -> dict[str, Path]:
    paths = {name: turbospark_install(name) for name in FIXTURES if name not in TINY}
    paths |= {name: turbospark_tiny_install(name, *TINY[name]) for name in TINY}
    paths["dflash"] = turbospark_install("llama_dflash")
    paths["dflash_drafter"] = turbospark_install("dflash", root=turbospark_fixtures / "llama_dflash")
    paths["dummy"] = turbospark_tiny_install("dummy", DUMMY, DUMMY_TENSORS)
    return paths


@pytest.fixture(scope="module")
def single(installs: dict[str, Path], turbospark_fixtures: Path) -> dict[str, Any]:
    """What one process computes for the same calls."""
    out: dict[str, Any] = {}
    for name, options in FIXTURES.items():
        runner = turbospark_core.open(installs[name], **options)
        ids = _prompt(turbospark_fixtures, name)
        out[name] = {
            "logits": runner.logits(ids),
            "decode_logits": worker.decode_logits(runner, ids),
            "greedy": runner.generate(ids, max_tokens=16, temperature=0.0).tokens,
        }
        if "mtp" in options:
            out[name]["draft_logits"] = runner.draft_logits(ids)
        if runner.opened.experts is not None:
            out[name]["expert_bytes"] = sum(
                x.num_experts * x.stride for x in runner.opened.experts.layout.layers.values()
            )
    dflash = turbospark_core.open(installs["dflash"], dflash=installs["dflash_drafter"], num_draft_tokens=3)
    ids = _prompt(turbospark_fixtures, "llama_dflash")
    out["dflash"] = {"logits": dflash.logits(ids), "greedy": dflash.generate(ids, max_tokens=16).tokens}
    out["dflash"]["dflash_logits"] = dflash.dflash_block_logits(ids)
    out["features"] = _single_features(installs["llama"])
    return out


PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 9, 9, 9, 9]]
SESSION = [1, 2, 3, 4, 5]
DIRECTIONS = {0: np.linspace(-1, 1, 64, dtype=np.float32), 1: np.ones(64, np.float32)}


def _single_features(path: Path) -> dict[str, Any]:
    runner = turbospark_core.open(path, session_slots=2)
    session = runner.session("a")
    first = session.generate(SESSION, max_tokens=4)
    second = session.generate([*SESSION, *first.tokens, 7, 8], max_tokens=4)
    steering = DirectionSet.from_arrays(DIRECTIONS, mode="add", scale=2.0)
    return {
        "many": [g.tokens for g in runner.generate_many(PROMPTS, max_tokens=6)],
        "session": [first.tokens, second.tokens, second.stats.reused_tokens],
        "steered": runner.logits(SESSION, steering=steering),
        "capture": np.asarray(runner.capture([SESSION, [4, 5]], layers=[0, 1])),
        "seeded": runner.generate(SESSION, max_tokens=8, temperature=0.9, seed=7).tokens,
        "greedy": runner.generate(SESSION, max_tokens=8).tokens,
        "cli": runner.generate("Once upon", max_tokens=6).text + "\n",
    }


def _job(mode: str, installs: dict[str, Path], fixtures: Path, tmp_path: Path, tiny: Path) -> dict[str, Any]:
    models = {
        name: {"path": str(installs[name]), "options": options, "prompt": _prompt(fixtures, name), "max_tokens": 16}
        for name, options in FIXTURES.items()
    }
    models["qwen3_5_mtp"]["draft_logits"] = True
    models["dflash"] = {
        "path": str(installs["dflash"]),
        "options": {"dflash": str(installs["dflash_drafter"]), "num_draft_tokens": 3},
        "prompt": _prompt(fixtures, "llama_dflash"),
        "max_tokens": 16,
        "dflash_logits": True,
    }
    refusals = [
        {"path": str(installs["llama"]), "options": {"router_histogram": True}},
        {"path": str(installs["llama"]), "options": {"ngram": 3}},
        {"path": str(installs["dummy"])},
        {"path": str(tiny)},
    ]
    features = {
        "path": str(installs["llama"]),
        "prompts": PROMPTS,
        "session": SESSION,
        "directions": {str(k): v.tolist() for k, v in DIRECTIONS.items()},
    }
    return {"mode": mode, "out": str(tmp_path), "models": models, "features": features, "refusals": refusals}


def _close(got: Any, want: np.ndarray, *, exact: bool) -> float:
    diff = float(np.abs(np.asarray(got, np.float32) - want).max())
    bound = 0.0 if exact else TOLERANCE * max(1.0, float(np.abs(want).max()))
    assert diff <= bound, f"max |difference| {diff:.3g} exceeds {bound:.3g}"
    return diff


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_two_ranks_compute_what_one_process_computes(
    mode: str,
    installs: dict[str, Path],
    single: dict[str, Any],
    turbospark_fixtures: Path,
    turbospark_tiny_install: Callable[..., Path],
    tmp_path: Path,
) -> None:
    tiny = turbospark_tiny_install("llama_three_heads", INDIVISIBLE, llama_tensor_shapes(INDIVISIBLE))
    ranks = _run(_job(mode, installs, turbospark_fixtures, tmp_path, tiny), tmp_path)
    exact = mode == "pipeline"
    for rank, got in enumerate(ranks):
        for name, want in single.items():
            if name == "features":
                continue
            mine = got["models"][name]
            assert mine["greedy"] == want["greedy"], name
            _close(mine["logits"], want["logits"], exact=exact)
            for extra in ("decode_logits", "draft_logits", "dflash_logits"):
                if extra in want:
                    _close(mine[extra], want[extra], exact=exact)
            assert f"{mode} parallel, rank {rank} of {RANKS}" in mine["info"]
            assert mine["bytes_read"] == mine["held_bytes"], f"{name}: rank {rank} read other bytes than its share"
        _check_features(got["features"], single["features"], exact=exact, rank=rank)
        _check_refusals(got["refusals"], mode)
    _check_shares(ranks, mode, single["qwen3_5_moe"]["expert_bytes"])
    assert ranks[0]["features"]["unseeded"] == ranks[1]["features"]["unseeded"]  # the ranks sample alike


def _check_features(got: dict[str, Any], want: dict[str, Any], *, exact: bool, rank: int) -> None:
    for key in ("many", "session", "seeded"):
        assert got[key] == want[key], key
    assert got["session"][2] > 0  # the second turn reused the session's prefix
    _close(got["steered"], want["steered"], exact=exact)
    _close(got["capture"], want["capture"], exact=exact)
    assert got["draft_model"] == want["greedy"]  # speculative decoding with a draft model is lossless
    assert got["cli"] == (want["cli"] if rank == 0 else "")  # rank 0 prints, the others run quietly


def _check_refusals(messages: list[str], mode: str) -> None:
    histogram, adaptive, no_plan, heads = messages
    assert histogram.startswith("DistributedError: router_histogram=True with distributed=")
    assert "needs num_draft_tokens=K" in adaptive
    assert "family 'dummy' (turbospark-dummy) declares no distributed plan" in no_plan
    if mode == "tensor":
        assert "cannot split num_attention_heads=3 (neither divides the other)" in heads
        assert "use distributed='pipeline'" in heads
    else:
        assert heads == "opened"


def _check_shares(ranks: list[dict[str, Any]], mode: str, total: int) -> None:
    """Each rank holds its own share: the streamed experts.bin records are disjoint and cover the file's."""
    records = [r["models"]["qwen3_5_moe"]["expert_records"] for r in ranks]
    flat = sorted(tuple(span) for spans in records for span in spans)
    assert all(a[0] + a[1] <= b[0] for a, b in itertools.pairwise(flat)), "two ranks hold one record"
    assert sum(n for _, n in flat) == total  # and together every record
    assert all(r["models"]["qwen3_5_moe"]["expert_stats"][0] > 0 for r in ranks)  # both streamed their misses
    if mode == "tensor":  # every routed layer is split: each rank holds some of every layer's records
        assert len(records[0]) == len(records[1]) == len(flat) // 2


# ------------------------------------------------------------------ the server
def _request(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server launch exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(f"{url}/health", timeout=5) as r,
        ):
            if r.status == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"the server did not answer /health within {LAUNCH_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def _ranks_of(launcher: int) -> dict[int, int]:
    """pid by rank of the processes ``mlx.launch`` (pid ``launcher``) started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v)
            if "MLX_RANK" in env:
                found[int(env["MLX_RANK"])] = int(entry.name)
    return found


def test_rank_0_serves_http_and_the_other_ranks_follow(installs: dict[str, Path], tmp_path: Path) -> None:
    path = installs["llama"]
    reference = turbospark_core.open(path, session_slots=2)
    prompts = ["Once upon a time", "The quick brown fox"]
    want = [reference.generate(p, max_tokens=8).text for p in prompts]
    messages = [{"role": "user", "content": "Hello there"}]
    port = _free_ports(1)
    url = f"http://127.0.0.1:{port}"
    command = [
        "-m", "turbospark_core.cli", "serve", str(path), "--port", str(port), "--session-slots", "2",
        "--distributed", "tensor",
    ]  # fmt: skip
    log = tmp_path / "serve.log"
    with launched(command, log) as proc:
        _wait_healthy(url, proc, log)
        got: list[str] = ["", ""]

        def complete(i: int) -> None:
            body = {"model": "m", "prompt": prompts[i], "max_tokens": 8, "temperature": 0}
            got[i] = _request(f"{url}/v1/completions", body)["choices"][0]["text"]

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(2)]  # decoded in one batch
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=LAUNCH_TIMEOUT_S)
        assert got == want
        chat = {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0, "session_id": "s"}
        first = _request(f"{url}/v1/chat/completions", chat)
        reply = first["choices"][0]["message"]["content"]
        assert reply == reference.chat(messages, max_tokens=6).text
        turn = {
            **chat,
            "messages": [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Go on"}],
        }
        second = _request(f"{url}/v1/chat/completions", turn)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the session slot on every rank
        ranks = _ranks_of(proc.pid)
        assert sorted(ranks) == [0, 1], log.read_text()[-2000:]
        os.kill(ranks[0], signal.SIGTERM)  # rank 0 stops serving and tells the others to stop
        assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
