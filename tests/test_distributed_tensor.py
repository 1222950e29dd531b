"""The tensor-parallel objects on a group of one process: each rank's share, summed or gathered, is the whole.

Here each "rank" is built over a slice and the collective of a one-process
group returns its input, so adding (or concatenating) the ranks' outputs is
what the collective does across processes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from turbospark_core.distributed import world
from turbospark_core.distributed.tensor import ExpertParallel, GatheredLinear, RowLinear, VocabEmbedding, gather_last
from turbospark_core.layers import Embedding, ExpertBank, Linear, silu_mul

rng = np.random.default_rng(0)
GROUP = world().handle


def _a(*shape: int) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32))


def test_row_parallel_parts_sum_to_the_whole_and_add_the_bias_once() -> None:
    w, b, x = _a(8, 6), _a(8), _a(2, 3, 6)
    parts = [RowLinear(Linear(w[:, i : i + 3], b), GROUP) for i in (0, 3)]
    total = parts[0](x[..., :3]) + parts[1](x[..., 3:]) - b  # each rank adds the bias after its sum
    assert np.allclose(np.array(total), np.array(Linear(w, b)(x)), atol=1e-6)
    assert parts[0].bias is None and parts[0].after is b


def test_gathered_head_concatenates_each_ranks_rows_along_the_last_axis() -> None:
    w, x = _a(10, 4), _a(2, 3, 4)
    assert mx.array_equal(GatheredLinear(Linear(w), GROUP)(x), Linear(w)(x))
    y = _a(2, 3, 5)
    assert mx.array_equal(gather_last(y, GROUP), y)


def test_vocabulary_rows_split_lookups_add_up_exactly() -> None:
    table, ids = _a(10, 4), mx.array([[0, 4, 5, 9], [7, 2, 2, 5]])
    halves = [
        VocabEmbedding(GatheredLinear(Linear(table[a:b]), GROUP), mx.float32, (a, b), GROUP)
        for a, b in ((0, 5), (5, 10))
    ]
    assert mx.array_equal(halves[0](ids) + halves[1](ids), Embedding(Linear(table))(ids))
    assert mx.array_equal(halves[1](mx.array([[1]])), mx.zeros((1, 1, 4)))  # another rank's row: zeros here
    assert mx.array_equal(halves[0].as_linear(_a(3, 4) * 0), mx.zeros((3, 5)))  # a tied head: this rank's logits


def test_expert_parallel_ranks_compute_their_pairs_only_and_add_up_to_the_bank() -> None:
    E, D, F = 8, 6, 5
    gate, up, down = _a(E, F, D), _a(E, F, D), _a(E, D, F)
    bank = ExpertBank(Linear(gate), Linear(up), Linear(down))
    x = _a(2, 3, D)
    indices = mx.array(rng.integers(0, E, (2, 3, 2)).astype(np.uint32))
    halves = [
        ExpertParallel(ExpertBank(Linear(gate[a:b]), Linear(up[a:b]), Linear(down[a:b])), a, b - a, E, GROUP)
        for a, b in ((0, 4), (4, 8))
    ]
    got = [h.glu(x, indices, silu_mul) for h in halves]
    assert got[0].shape == (2, 3, 2, D) and halves[0].num_experts == E
    held = np.array(indices) < 4
    assert np.all(np.array(got[0])[~held] == 0) and np.all(np.array(got[1])[held] == 0)
    assert np.allclose(np.array(got[0] + got[1]), np.array(bank.glu(x, indices, silu_mul)), atol=1e-6)
    none = ExpertParallel(bank, 8, 0, 16, GROUP).glu(x, indices, silu_mul)  # no pair routed here: zeros, one sum
    assert mx.array_equal(none, mx.zeros((2, 3, 2, D)))
