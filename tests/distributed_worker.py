"""One rank of the launched distributed checks (``tests/test_distributed_launch.py`` runs it under ``mlx.launch``).

Reads a job (JSON: the mode, the installs and what to run on them), runs it
with ``distributed=MODE`` and writes what it got to ``OUT/rank<R>.json``; the
test compares that with single-process runs. Every rank runs the same calls,
as the distributed API asks.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

DECODE_STEPS = 4


def decode_logits(runner: Any, ids: list[int], steps: int = DECODE_STEPS) -> np.ndarray:
    """Logits of the prompt's last ``steps`` tokens fed one at a time after the rest: the cached one-token path."""
    import mlx.core as mx

    cache = runner.opened.new_cache()
    mx.eval(runner.model(mx.array([ids[:-steps]]), cache))
    rows = []
    for token in ids[-steps:]:
        rows.append(runner.model(mx.array([[token]]), cache)[0, -1])
        mx.eval(rows[-1])
    return np.stack([np.array(r) for r in rows])


def _model_checks(t: Any, mode: str, job: dict[str, Any]) -> dict[str, Any]:
    runner = t.open(job["path"], distributed=mode, **job.get("options", {}))
    ids = job["prompt"]
    weights = runner.opened.weights
    out: dict[str, Any] = {
        "logits": runner.logits(ids).tolist(),
        "decode_logits": decode_logits(runner, ids).tolist(),
        "greedy": runner.generate(ids, max_tokens=job["max_tokens"], temperature=0.0).tokens,
        "info": runner.opened.distributed.describe(),
        "bytes_read": weights.reader.bytes_read,
        "held_bytes": weights.share.local_index().stored_bytes(),
    }
    experts = runner.opened.experts
    if experts is not None:
        layers = experts.layout.layers.values()
        out["expert_records"] = sorted([x.offset, x.num_experts * x.stride] for x in layers)
        out["expert_stats"] = [runner.expert_stats().misses, runner.expert_stats().bytes_read]
    if job.get("draft_logits"):
        out["draft_logits"] = runner.draft_logits(ids).tolist()
    if job.get("dflash_logits"):
        out["dflash_logits"] = runner.dflash_block_logits(ids).tolist()
    return out


def _feature_checks(t: Any, mode: str, job: dict[str, Any]) -> dict[str, Any]:
    """Batching, sessions, steering, capture, sampling, drafters and the CLI, with ``distributed=mode``."""
    from turbospark_core.steering import DirectionSet

    path, session_ids = job["path"], job["session"]
    runner = t.open(path, distributed=mode, session_slots=2, ngram=3, num_draft_tokens=2)
    out: dict[str, Any] = {"many": [g.tokens for g in runner.generate_many(job["prompts"], max_tokens=6)]}
    session = runner.session("a")
    first = session.generate(session_ids, max_tokens=4)
    second = session.generate([*session_ids, *first.tokens, 7, 8], max_tokens=4)
    out["session"] = [first.tokens, second.tokens, second.stats.reused_tokens]
    directions = {int(k): np.asarray(v, np.float32) for k, v in job["directions"].items()}
    steering = DirectionSet.from_arrays(directions, mode="add", scale=2.0)
    out["steered"] = runner.logits(session_ids, steering=steering).tolist()
    out["capture"] = np.asarray(runner.capture([session_ids, [4, 5]], layers=[0, 1])).tolist()
    out["seeded"] = runner.generate(session_ids, max_tokens=8, temperature=0.9, seed=7).tokens
    out["unseeded"] = runner.generate(session_ids, max_tokens=8, temperature=0.9).tokens  # the ranks must agree
    draft = t.open(path, distributed=mode, draft_model=path, num_draft_tokens=2)
    out["draft_model"] = draft.generate(session_ids, max_tokens=8).tokens
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        from turbospark_core.cli import main

        main(["generate", path, "Once upon", "--max-tokens", "6", "--distributed", mode])
    out["cli"] = printed.getvalue()
    return out


def _refusals(t: Any, mode: str, jobs: list[dict[str, Any]]) -> list[str]:
    messages = []
    for job in jobs:
        try:
            t.open(job["path"], distributed=mode, **job.get("options", {}))
        except t.TurbosparkError as e:
            messages.append(f"{type(e).__name__}: {e}")
        else:
            messages.append("opened")
    return messages


def main() -> None:
    import mlx.core as mx

    import turbospark_core as t

    job = json.loads(Path(sys.argv[1]).read_text())
    rank = mx.distributed.init().rank()
    mode = job["mode"]
    result: dict[str, Any] = {"refusals": _refusals(t, mode, job.get("refusals", []))}
    result["models"] = {name: _model_checks(t, mode, spec) for name, spec in job["models"].items()}
    if job.get("features"):
        result["features"] = _feature_checks(t, mode, job["features"])
    Path(job["out"], f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
