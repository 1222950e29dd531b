"""``turbospark bench``: prefill and decode throughput and peak memory at a few prompt lengths.

Each length runs on a fresh cache: a prompt of random token ids is
prefilled in the Runner's chunks, then ``decode_tokens`` tokens are decoded
greedily (EOS does not stop a benchmark), pipelined as the Runner does. A
short unmeasured run first pays for one-time setup. With batch sizes,
:func:`run_batches` also measures aggregate throughput of B rows decoded
together (``Runner.generate_many``: one forward per step for every row).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.errors import OptionError
from turbospark_core.progress import progress
from turbospark_core.runner import PREFILL_CHUNK

if TYPE_CHECKING:
    from turbospark_core.kv_cache import Cache
    from turbospark_core.runner import Runner

DEFAULT_LENGTHS = (128, 512, 2048)
DEFAULT_DECODE_TOKENS = 32
_SEED = 0


@attrs.frozen(kw_only=True)
class BenchRow:
    """One prompt length's measurements."""

    prompt_tokens: int
    prefill_s: float
    prefill_tps: float
    decode_tokens: int
    decode_s: float
    decode_tps: float
    peak_memory_gb: float
    expert_hit_rate: float | None = None  # streamed MoE: slot hits over lookups during this row

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return attrs.asdict(self)


@attrs.frozen(kw_only=True)
class BatchRow:
    """One batch size's aggregate throughput (prefill of every row included)."""

    rows: int
    prompt_tokens: int
    generated: int
    seconds: float
    aggregate_tps: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return attrs.asdict(self)


def run_batches(
    runner: Runner,
    sizes: Sequence[int],
    prompt_tokens: int,
    decode_tokens: int = DEFAULT_DECODE_TOKENS,
    *,
    show_progress: bool = True,
) -> list[BatchRow]:
    """Aggregate tok/s of ``B`` greedy rows of random prompts decoded together, for each ``B`` in ``sizes``."""
    bad = [b for b in sizes if isinstance(b, bool) or not isinstance(b, int) or b < 1]
    if bad:
        raise OptionError(f"batch size {bad[0]!r} is invalid; use positive numbers of rows")
    (length,) = prompt_lengths([prompt_tokens], runner.max_context, decode_tokens)
    rng = np.random.default_rng(_SEED)
    vocab = int(runner.manifest.arch["vocab_size"])
    runner.generate_many([rng.integers(0, vocab, 8).tolist()], max_tokens=2)  # unmeasured: one-time setup
    out = []
    for size in progress(sorted(set(sizes)), len(set(sizes)), "bench batches", enabled=show_progress):
        prompts = [rng.integers(0, vocab, length).tolist() for _ in range(size)]
        t0 = time.perf_counter()
        gens = runner.generate_many(prompts, max_tokens=decode_tokens, max_rows=size)
        seconds = time.perf_counter() - t0
        generated = sum(len(g.tokens) for g in gens)
        out.append(
            BatchRow(
                rows=size,
                prompt_tokens=length,
                generated=generated,
                seconds=seconds,
                aggregate_tps=generated / seconds if seconds else 0.0,
            )
        )
    return out


def batch_table(rows: Sequence[BatchRow]) -> str:
    """The batch rows as an aligned text table (aggregate tok/s against one row's)."""
    base = rows[0].aggregate_tps if rows and rows[0].aggregate_tps else None
    lines = [f"{'rows':>6} {'prompt':>8} {'generated':>10} {'aggregate tok/s':>16} {'vs first':>9}"]
    for r in rows:
        ratio = f"{r.aggregate_tps / base:>8.2f}x" if base else f"{'-':>9}"
        lines.append(f"{r.rows:>6} {r.prompt_tokens:>8} {r.generated:>10} {r.aggregate_tps:>16.1f} {ratio}")
    return "\n".join(lines)


def prompt_lengths(requested: Iterable[int], max_context: int, decode_tokens: int) -> list[int]:
    """``requested`` clipped so prompt + decode fits ``max_context`` (sorted, duplicates dropped)."""
    room = max_context - decode_tokens
    if room < 1:
        msg = f"--decode-tokens {decode_tokens} leaves no room for a prompt in max_context={max_context}; lower it"
        raise OptionError(msg)
    bad = [n for n in requested if n < 1]
    if bad:
        raise OptionError(f"prompt length {bad[0]} is invalid; use positive numbers of tokens")
    return sorted({min(n, room) for n in requested})


def run(
    runner: Runner,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    decode_tokens: int = DEFAULT_DECODE_TOKENS,
    *,
    show_progress: bool = True,
) -> list[BenchRow]:
    """Measure every length in ``lengths`` (clipped to the Runner's ``max_context``)."""
    if decode_tokens < 1:
        raise OptionError(f"decode_tokens={decode_tokens} is invalid; decode at least one token")
    todo = prompt_lengths(lengths, runner.max_context, decode_tokens)
    rng = np.random.default_rng(_SEED)
    vocab = int(runner.manifest.arch["vocab_size"])
    _measure(runner, rng.integers(0, vocab, min(8, todo[0])).tolist(), 2)  # unmeasured: one-time setup
    return [
        _measure(runner, rng.integers(0, vocab, n).tolist(), decode_tokens)
        for n in progress(todo, len(todo), "bench", enabled=show_progress)
    ]


def _measure(runner: Runner, ids: list[int], decode_tokens: int) -> BenchRow:
    model = runner.model
    cache = runner.opened.new_cache()
    experts_before = runner.expert_stats()
    mx.eval([c.state for c in cache])
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    token = _prefill(model, ids, cache)
    mx.eval(token)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        token = mx.argmax(model(token[:, None], cache)[:, -1, :], axis=-1)
        mx.async_eval(token)  # type: ignore[no-untyped-call]  # mlx's stub leaves it unannotated
    mx.eval(token)
    decode_s = time.perf_counter() - t0
    after = runner.expert_stats()
    hit_rate = None
    if after is not None and experts_before is not None and after.residency == "streamed":
        hit_rate = after.since(experts_before).hit_rate
    return BenchRow(
        prompt_tokens=len(ids),
        prefill_s=prefill_s,
        prefill_tps=len(ids) / prefill_s if prefill_s else 0.0,
        decode_tokens=decode_tokens,
        decode_s=decode_s,
        decode_tps=decode_tokens / decode_s if decode_s else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
        expert_hit_rate=hit_rate,
    )


def _prefill(model: Any, ids: list[int], cache: list[Cache]) -> mx.array:
    """The prompt in the Runner's chunks; the greedy next token ``[1]``."""
    for start in range(0, len(ids) - 1, PREFILL_CHUNK):
        model(mx.array([ids[start : min(start + PREFILL_CHUNK, len(ids) - 1)]]), cache)
        mx.eval([c.state for c in cache])
    return mx.argmax(model(mx.array([ids[-1:]]), cache)[:, -1, :], axis=-1)


def table(rows: Sequence[BenchRow]) -> str:
    """The rows as an aligned text table."""
    streamed = any(r.expert_hit_rate is not None for r in rows)
    head = f"{'prompt':>8} {'prefill tok/s':>14} {'decode tok/s':>13} {'peak GB':>9}" + (
        "  expert hits" if streamed else ""
    )
    lines = [head]
    for r in rows:
        line = f"{r.prompt_tokens:>8} {r.prefill_tps:>14.1f} {r.decode_tps:>13.1f} {r.peak_memory_gb:>9.3f}"
        if streamed:
            line += f"  {r.expert_hit_rate:>10.1%}" if r.expert_hit_rate is not None else "  -"
        lines.append(line)
    return "\n".join(lines)
