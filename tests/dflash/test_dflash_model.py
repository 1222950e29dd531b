"""The drafter network against references_dflash.npz (z-lab's own code): context, round 1, round 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from turbospark_core.runner import Runner
from turbospark_core.speculative.dflash import DFlashFactory

ABS_TOL = 1e-4  # max |logit - reference| (the fixtures README's suggestion)
Factory = Callable[[Runner, Path], DFlashFactory]


def _rows(hidden: np.ndarray) -> dict[int, mx.array]:
    return {0: mx.array(hidden[0])}


def test_context_is_hidden_norm_of_fc(fx: Any, factory_for: Factory) -> None:
    factory = factory_for(fx.open(), fx.drafter)
    got = np.array(factory.network.context([mx.array(fx.refs["target_hidden"][0])])[0])
    assert np.abs(got - fx.refs["round1_draft_context"]).max() <= 1e-5


def test_round1_matches_reference(fx: Any, factory_for: Factory) -> None:
    refs = fx.refs
    factory = factory_for(fx.open(), fx.drafter)
    logits = np.array(factory.block_logits(_rows(refs["target_hidden"]), int(refs["round1_block_ids"][0])))
    assert logits.shape == refs["round1_logits"].shape
    assert np.abs(logits - refs["round1_logits"]).max() <= ABS_TOL
    assert logits.argmax(-1).tolist() == refs["round1_draft_tokens"].tolist()


def test_round2_keeps_round1_context(fx: Any, factory_for: Factory) -> None:
    """Round 2 sees the prompt's context from round 1's cache plus [b0, d1..dk] of the verify."""
    refs = fx.refs
    T, k = len(refs["prompt_ids"]), int(refs["accept_k"])
    drafter = factory_for(fx.open(), fx.drafter)()
    drafter.observe(0, _rows(refs["target_hidden"]))
    first = np.array(drafter.round_logits(int(refs["round1_block_ids"][0]), T))
    assert np.abs(first - refs["round1_logits"]).max() <= ABS_TOL
    drafter.observe(T, _rows(refs["round2_target_hidden"]))
    drafter.rewind(T + 1 + k + 1)  # prompt + b0 + k accepted + the bonus token (the round-2 anchor)
    assert int(refs["round2_positions"][0]) == T + k + 1
    second = np.array(drafter.round_logits(int(refs["round2_block_ids"][0]), T + k + 1))
    assert drafter.context_length == T + k + 1
    assert np.abs(second - refs["round2_logits"]).max() <= ABS_TOL
    assert second.argmax(-1).tolist() == refs["round2_draft_tokens"].tolist()


def test_targets_own_states_give_the_reference(fx: Any, factory_for: Factory) -> None:
    """The target's captured layer outputs are the states z-lab's code fed its drafter."""
    refs = fx.refs
    runner = fx.open()
    layers = [int(i) for i in refs["target_layer_ids"]]
    states = runner.capture([refs["prompt_ids"].tolist()], layers=layers, position="all")[0]
    assert np.abs(states.transpose(1, 0, 2) - refs["target_hidden"]).max() <= 1e-4
    factory = factory_for(runner, fx.drafter)
    hidden = {layer: mx.array(states[:, i]) for i, layer in enumerate(layers)}
    logits = np.array(factory.block_logits(hidden, int(refs["round1_block_ids"][0])))
    assert np.abs(logits - refs["round1_logits"]).max() <= ABS_TOL
