"""DFlash on sliding-window (gpt_oss) and hybrid linear-attention (qwen3_5) targets: lossless, exact rounds.

No DFlash references exist for these targets: a random drafter reading two target layers (the
concatenation order) drafts, so its drafts are rejected and every verify rewinds a ring or a recurrent
state; an oracle then makes the target accept drafts. Greedy output must equal plain greedy, and every
round's logits must equal a fresh forward over the committed context.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import turbospark_core
from turbospark_core import plugins
from turbospark_core.convert import convert
from turbospark_core.speculative.dflash import DFlashDrafter
from turbospark_core.speculative.drafter import Draft

TARGETS = {"gpt_oss": [0, 1], "qwen3_5": [2, 0]}  # layers read, in concatenation order


@pytest.fixture(scope="module", params=sorted(TARGETS))
def target(
    request: pytest.FixtureRequest,
    turbospark_fixtures: Path,
    tmp_path_factory: pytest.TempPathFactory,
    random_drafter: Callable[..., Path],
) -> Any:
    name = request.param
    src = turbospark_fixtures / name
    if not (src / "config.json").is_file():
        pytest.skip(f"reference fixture {src} is not available")
    config = json.loads((src / "config.json").read_text())
    config = config.get("text_config", config)
    if not plugins.registry().serves(json.loads((src / "config.json").read_text())["model_type"]):
        pytest.skip(f"no installed plugin serves {name}")
    root = tmp_path_factory.mktemp(name)
    convert(src, root / "target")
    random_drafter(
        root / "ckpt",
        hidden=config["hidden_size"],
        vocab=config["vocab_size"],
        target_layers=TARGETS[name],
        num_target_layers=config["num_hidden_layers"],
    )
    convert(root / "ckpt", root / "drafter")
    with np.load(src / "references.npz") as npz:
        prompt = npz["prompt_ids"].tolist()
    return root / "target", root / "drafter", prompt


def test_greedy_is_lossless_with_rejected_drafts(target: Any) -> None:
    path, drafter, prompt = target
    plain = turbospark_core.open(path).generate(prompt, 12).tokens
    out = turbospark_core.open(path, dflash=drafter, num_draft_tokens=7).generate(prompt, 12)
    assert out.tokens == plain
    assert out.stats.draft_tokens > 0


def test_accepted_drafts_keep_rounds_exact(target: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path, drafter, prompt = target
    full = prompt + turbospark_core.open(path).generate(prompt, 12).tokens
    runner = turbospark_core.open(path, dflash=drafter, num_draft_tokens=3)
    checked: list[float] = []
    propose = DFlashDrafter.propose

    def oracle(self: DFlashDrafter, context: list[int], k: int, sampler: Any) -> Draft:
        incremental = np.array(self.round_logits(context[-1], len(context) - 1))
        checked.append(float(np.abs(incremental - runner.dflash_block_logits(context)).max()))
        propose(self, context, k, sampler)
        # two right drafts, then a wrong one: accepting and rejecting in the same verify
        right = full[len(context) : len(context) + 3]
        return Draft(tokens=[*right[:2], (right[-1] + 1) % 512][:k])

    monkeypatch.setattr(DFlashDrafter, "propose", oracle)
    out = runner.generate(prompt, 12)
    assert out.tokens == full[len(prompt) :]
    assert out.stats.accepted_tokens > 0 and out.stats.accepted_tokens < out.stats.draft_tokens
    assert len(checked) >= 3 and max(checked) <= 1e-4, checked
