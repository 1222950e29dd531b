"""Opening a DFlash drafter against its target (every refusal), and the per-sequence drafter."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
import pytest

from turbospark_core.errors import ArchConfigError, FamilyRefusalError, FileTableError, InstallError, NotAnInstallError
from turbospark_core.manifest import MANIFEST, WEIGHTS
from turbospark_core.runner import Runner
from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative.dflash import DFlashFactory, DrafterMismatchError, target_projections

ABS_TOL = 1e-4
Factory = Callable[[Runner, Path], DFlashFactory]


def _edit_arch(root: Path, **changes: Any) -> None:
    raw = json.loads((root / MANIFEST).read_text())
    raw["arch"] |= changes
    (root / MANIFEST).write_text(json.dumps(raw))


def _rewrite_weights(root: Path, edit: Callable[[dict[str, mx.array]], object]) -> None:
    """Edit the install's tensors and record the new file's true size and sha256 (a consistent install)."""
    path = root / WEIGHTS
    tensors = dict(mx.load(str(path)))  # type: ignore[arg-type]
    edit(tensors)
    mx.save_safetensors(str(path), tensors)
    raw = json.loads((root / MANIFEST).read_text())
    data = path.read_bytes()
    raw["files"][WEIGHTS] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (root / MANIFEST).write_text(json.dumps(raw))


# ------------------------------------------------------------------ refusals at open
def test_a_missing_path_is_refused(fx: Any, tmp_path: Path, factory_for: Factory) -> None:
    with pytest.raises(InstallError, match="is not a directory"):
        factory_for(fx.open(), tmp_path / "nothing")


def test_a_checkpoint_is_refused(fx: Any, factory_for: Factory) -> None:
    with pytest.raises(NotAnInstallError, match="is a checkpoint, not a turbospark install; make one with"):
        factory_for(fx.open(), fx.source / "dflash")


def test_a_model_install_is_refused(fx: Any, factory_for: Factory) -> None:
    with pytest.raises(NotAnInstallError, match=r"is a 'model' install .* not a DFlash drafter install"):
        factory_for(fx.open(), fx.target)


def test_a_tampered_arch_is_refused(fx: Any, drafter_copy: Path, factory_for: Factory) -> None:
    _edit_arch(drafter_copy, block_size=1)
    with pytest.raises(ArchConfigError, match="DFlash drafter's arch config is invalid: 'block_size' must be at least"):
        factory_for(fx.open(), drafter_copy)


def test_a_truncated_weights_file_is_refused(fx: Any, drafter_copy: Path, factory_for: Factory) -> None:
    path = drafter_copy / WEIGHTS
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(FileTableError, match=r"'model_weights.safetensors' is .* shorter"):
        factory_for(fx.open(), drafter_copy)


def test_another_hidden_size_is_refused(fx: Any, drafter_copy: Path, factory_for: Factory) -> None:
    _edit_arch(drafter_copy, hidden_size=32)
    with pytest.raises(DrafterMismatchError, match=r"has hidden_size 32, the target .* 64"):
        factory_for(fx.open(), drafter_copy)


def test_a_layer_the_target_lacks_is_refused(fx: Any, drafter_copy: Path, factory_for: Factory) -> None:
    _edit_arch(drafter_copy, target_layer_ids=[5])
    with pytest.raises(DrafterMismatchError, match=r"reads target layer 5 .* the target has layers 0..1"):
        factory_for(fx.open(), drafter_copy)


def test_a_mask_id_outside_the_vocabulary_is_refused(fx: Any, drafter_copy: Path, factory_for: Factory) -> None:
    _edit_arch(drafter_copy, vocab_size=1024, mask_token_id=600)
    with pytest.raises(DrafterMismatchError, match=r"mask_token_id 600, outside the target's vocabulary \[0, 512\)"):
        factory_for(fx.open(), drafter_copy)


def test_tensors_that_do_not_fit_the_arch_are_refused(fx: Any, drafter_copy: Path, factory_for: Factory) -> None:
    _edit_arch(drafter_copy, intermediate_size=8)
    with pytest.raises(InstallError, match=r"tensor 'layers.0.mlp.gate_proj.weight' has shape \[\d+, 64\]"):
        factory_for(fx.open(), drafter_copy)


def test_a_foreign_tensor_in_the_install_is_refused(fx: Any, drafter_copy: Path, factory_for: Factory) -> None:
    _rewrite_weights(drafter_copy, lambda t: t.update({"lm_head.weight": mx.zeros((512, 64))}))
    with pytest.raises(InstallError, match=r"has tensor 'lm_head.weight', which its arch config does not name"):
        factory_for(fx.open(), drafter_copy)


def test_a_missing_tensor_in_the_install_is_refused(fx: Any, drafter_copy: Path, factory_for: Factory) -> None:
    _rewrite_weights(drafter_copy, lambda t: t.pop("norm.weight"))
    with pytest.raises(InstallError, match=r"lacks tensor 'norm.weight', which its arch config does need"):
        factory_for(fx.open(), drafter_copy)


def test_a_flow_without_layer_outputs_is_refused(fx: Any, factory_for: Factory) -> None:
    runner = fx.open()
    opened = attrs.evolve(
        runner.opened, capabilities=attrs.evolve(runner.opened.capabilities, steering_refusal="no layer loop")
    )
    with pytest.raises(FamilyRefusalError, match=r"dflash refused by family .*layer outputs.*\(no layer loop\)"):
        factory_for(Runner(opened, runner.tokenizer), fx.drafter)


def test_a_model_without_embedding_and_head_is_refused() -> None:
    with pytest.raises(FamilyRefusalError, match=r"dflash refused by family 'odd': .* no `embed_tokens` Embedding"):
        target_projections(object(), "odd")


# ------------------------------------------------------------------ the drafter
def _prompt_states(runner: Runner, ids: list[int], layers: list[int]) -> np.ndarray:
    """The target's layer outputs of ``ids``: ``[len(ids), len(layers), H]``."""
    out = runner.capture([ids], layers=layers, position="all")
    assert isinstance(out, list)
    return out[0]


def test_rewind_drops_the_rejected_rows_of_a_verify(fx: Any, factory_for: Factory) -> None:
    """Observe every row of the round-1 verify, accept k: round 2 equals the reference."""
    refs = fx.refs
    runner = fx.open()
    prompt = refs["prompt_ids"].tolist()
    T, k = len(prompt), int(refs["accept_k"])
    states = _prompt_states(runner, prompt + refs["round1_verify_ids"].tolist(), [0])
    drafter = factory_for(runner, fx.drafter)()
    drafter.observe(0, {0: mx.array(states[:T, 0])})
    first = drafter.propose([*prompt, int(refs["round1_block_ids"][0])], 100, Sampler(SamplingParams()))
    assert list(first.tokens) == refs["round1_draft_tokens"].tolist()
    assert first.probs is None
    drafter.observe(T, {0: mx.array(states[T:, 0])})  # all 16 verify rows
    drafter.rewind(T + 1 + k + 1)
    committed = [*prompt, *refs["round1_verify_ids"][: k + 1].tolist(), int(refs["round2_block_ids"][0])]
    logits = np.array(drafter.round_logits(committed[-1], len(committed) - 1))
    assert np.abs(logits - refs["round2_logits"]).max() <= ABS_TOL
    assert drafter.context_length == T + k + 1


def test_propose_gives_at_most_k_drafts(fx: Any, factory_for: Factory) -> None:
    refs = fx.refs
    drafter = factory_for(fx.open(), fx.drafter)()
    drafter.observe(0, {0: mx.array(refs["target_hidden"][0])})
    context = [*refs["prompt_ids"].tolist(), int(refs["round1_block_ids"][0])]
    assert (
        list(drafter.propose(context, 3, Sampler(SamplingParams())).tokens) == refs["round1_draft_tokens"][:3].tolist()
    )
    assert len(drafter.propose(context, 1000, Sampler(SamplingParams())).tokens) == 15


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_sampled_drafts_come_with_their_distribution(fx: Any, factory_for: Factory, penalty: float) -> None:
    refs = fx.refs
    factory = factory_for(fx.open(), fx.drafter)
    context = [*refs["prompt_ids"].tolist(), int(refs["round1_block_ids"][0])]
    params = SamplingParams(temperature=0.8, top_k=40, repetition_penalty=penalty, seed=3)
    drafts = []
    for _ in range(2):
        drafter = factory()
        drafter.observe(0, {0: mx.array(refs["target_hidden"][0])})
        drafts.append(drafter.propose(context, 15, Sampler(params)))
    draft = drafts[0]
    assert draft.tokens == drafts[1].tokens  # seeded: reproducible
    assert draft.probs is not None and draft.probs.shape == (15, 512)
    probs = np.array(draft.probs)
    assert np.allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert ((probs > 0).sum(-1) <= 40).all()  # top-k applied
    assert all(probs[i, t] > 0 for i, t in enumerate(draft.tokens))


def test_reset_forgets_the_sequence(fx: Any, factory_for: Factory) -> None:
    refs = fx.refs
    drafter = factory_for(fx.open(), fx.drafter)()
    drafter.observe(0, {0: mx.array(refs["target_hidden"][0])})
    drafter.round_logits(int(refs["round1_block_ids"][0]), len(refs["prompt_ids"]))
    assert drafter.context_length == len(refs["prompt_ids"])
    drafter.reset()
    assert drafter.context_length == 0
    drafter.observe(0, {0: mx.array(refs["target_hidden"][0])})
    logits = np.array(drafter.round_logits(int(refs["round1_block_ids"][0]), len(refs["prompt_ids"])))
    assert np.abs(logits - refs["round1_logits"]).max() <= ABS_TOL


def test_unobserved_positions_leave_a_gap(fx: Any, factory_for: Factory) -> None:
    """A reused session prefix the drafter never saw: it drafts from what it has, keyed at true positions."""
    refs = fx.refs
    hidden = refs["target_hidden"][0]
    anchor, T = int(refs["round1_block_ids"][0]), len(refs["prompt_ids"])
    factory = factory_for(fx.open(), fx.drafter)

    def with_gap(shift: int, gap: int) -> tuple[np.ndarray, int]:
        drafter = factory()
        drafter.observe(shift, {0: mx.array(hidden[:10])})
        drafter.observe(shift + 10 + gap, {0: mx.array(hidden[20:])})
        logits = np.array(drafter.round_logits(anchor, shift + T - 10 + gap))
        held = drafter.context_length
        drafter.rewind(shift + 10 + gap + 5)  # keeps the first segment and 4 rows of the second
        assert drafter.context_length == 14
        return logits, held

    gapped, held = with_gap(0, 10)
    assert held == T - 10
    shifted, _ = with_gap(5, 10)
    assert np.abs(gapped - shifted).max() <= 1e-4  # RoPE is relative: one shift for all changes nothing
    closed, _ = with_gap(0, 0)
    assert np.abs(gapped - closed).max() > 1e-2  # the gap itself is seen: keys sit at their true positions


def test_sampled_q_is_the_reference_distribution(fx: Any, factory_for: Factory) -> None:
    """q of each slot is softmax(reference logits / T) over the top-k, computed independently here."""
    refs = fx.refs
    drafter = factory_for(fx.open(), fx.drafter)()
    drafter.observe(0, {0: mx.array(refs["target_hidden"][0])})
    context = [*refs["prompt_ids"].tolist(), int(refs["round1_block_ids"][0])]
    draft = drafter.propose(context, 15, Sampler(SamplingParams(temperature=0.5, top_k=8, seed=0)))
    scaled = refs["round1_logits"].astype(np.float64) / 0.5
    kth = np.sort(scaled, axis=-1)[:, -8][:, None]
    want = np.where(scaled >= kth, np.exp(scaled - scaled.max(-1, keepdims=True)), 0.0)
    want /= want.sum(-1, keepdims=True)
    assert draft.probs is not None
    assert np.abs(np.array(draft.probs) - want).max() <= 1e-4


def test_a_round_needs_an_anchor(fx: Any, factory_for: Factory) -> None:
    from turbospark_core.errors import OptionError

    with pytest.raises(OptionError, match="a DFlash round needs at least one committed token"):
        factory_for(fx.open(), fx.drafter)().propose([], 3, Sampler(SamplingParams()))
