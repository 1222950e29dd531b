"""The long fuzz run: ``python -m tests.fuzz.run [--inputs N] [--targets a,b] [--seed S] [--out DIR]``.

Runs N structure-aware mutated inputs per reader (default 100,000), seeded from
the reference fixtures and the SmolLM2 GGUF; prints counts per target (ok,
refused, escapes) and writes each escaping input with its error under ``--out``.
Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pickle
import random
import sys
import time
import traceback
from pathlib import Path

from tests.fuzz.targets import TARGETS, EscapeError, Seeds, run_one, smollm2_path, temp_work

FIXTURES = Path(os.environ.get("TURBOSPARK_FIXTURES", Path(__file__).resolve().parents[3] / "shared" / "fixtures"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--inputs", type=int, default=100_000)
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("fuzz-findings"))
    p.add_argument(
        "--seconds", type=float, default=None, help="stop a target after this long (counts say how far it got)"
    )
    p.add_argument("--report-every", type=int, default=5000)
    args = p.parse_args(argv)
    seeds = Seeds.make(FIXTURES, temp_work(), smollm2_path())
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {}
    for name in args.targets.split(","):
        summary[name] = _run_target(name, seeds, args)
        print(json.dumps({name: summary[name]}), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 1 if any(s.get("escapes") for s in summary.values()) else 0


def _run_target(name: str, seeds: Seeds, args: argparse.Namespace) -> dict[str, object]:
    target = TARGETS[name](seeds)
    rnd = random.Random(f"{args.seed}-{name}")
    counts: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    slowest, start = 0.0, time.perf_counter()
    done = 0
    for i in range(args.inputs):
        if args.seconds is not None and time.perf_counter() - start > args.seconds:
            break
        done += 1
        try:
            data = target.mutate(rnd)
        except Exception as e:  # noqa: BLE001 - a mutator bug must not end the run: count it
            counts["mutator_errors"] += 1
            kinds[f"mutator {type(e).__name__}"] += 1
            continue
        t0 = time.perf_counter()
        try:
            counts[run_one(target, data)] += 1
        except EscapeError as e:
            counts["escapes"] += 1
            kind = str(e).split(":")[1].strip() if ":" in str(e) else str(e)
            if kinds[kind] < 3:  # keep a few inputs of each kind of escape
                (args.out / f"{name}-{i}.pickle").write_bytes(pickle.dumps(data))
                trace = "".join(traceback.format_exception(e.__cause__)) if e.__cause__ else ""
                (args.out / f"{name}-{i}.txt").write_text(f"{e}\n{trace}")
            kinds[kind] += 1
        slowest = max(slowest, time.perf_counter() - t0)
        if args.report_every and (i + 1) % args.report_every == 0:
            print(
                f"{name}: {i + 1} inputs {dict(counts)} {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True
            )
    return {"inputs": done, **counts, "escape_kinds": dict(kinds), "slowest_s": round(slowest, 3),
            "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
