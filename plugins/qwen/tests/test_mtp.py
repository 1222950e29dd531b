"""The Qwen 3.5 multi-token-prediction head against references_mtp.npz, and what the converter keeps."""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert as convert_checkpoint
from turbospark_core.errors import ArchConfigError, DrafterError, MemoryBudgetError
from turbospark_core.manifest import MTP_HEAD, WEIGHTS, load_manifest
from turbospark_core.sampling import Sampler, SamplingParams
from turbospark_core.speculative import mtp

from turbospark_qwen import convert

FIXTURES = ("qwen3_5_mtp", "qwen3_5_moe_mtp")
TOL = 2e-5  # max abs; measured 5e-6 (the fixtures README allows 1e-4, as for `logits`)


@pytest.fixture(scope="module", params=FIXTURES)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def refs(turbospark_fixtures: Path, name: str) -> Any:
    return np.load(turbospark_fixtures / name / "references_mtp.npz")


@pytest.fixture(scope="module")
def greedy(turbospark_fixtures: Path, name: str) -> list[int]:
    return list(np.load(turbospark_fixtures / name / "references.npz")["greedy_tokens"].tolist())


@pytest.fixture(scope="module")
def runner(turbospark_install: Any, name: str) -> turbospark_core.Runner:
    return turbospark_core.open(turbospark_install(name))


def test_config_keeps_head_keys(turbospark_fixtures: Path, name: str) -> None:
    arch = convert.arch_from_hf(json.loads((turbospark_fixtures / name / "config.json").read_text()))
    assert arch["mtp_num_hidden_layers"] == 1 and arch["mtp_use_dedicated_embeddings"] is False
    base = name.removesuffix("_mtp")
    plain = convert.arch_from_hf(json.loads((turbospark_fixtures / base / "config.json").read_text()))
    assert "mtp_num_hidden_layers" not in plain


def test_head_goes_to_its_own_file(turbospark_install: Any, name: str) -> None:
    """The head's tensors (fused MoE experts split, as the trunk's) land in mtp.safetensors; the weights
    file is byte for byte the one the same checkpoint without a head makes."""
    install = Path(turbospark_install(name))
    plain = Path(turbospark_install(name.removesuffix("_mtp")))
    manifest = load_manifest(install)
    assert manifest.mtp == {"quantization": {}} and MTP_HEAD in manifest.files
    assert (install / WEIGHTS).read_bytes() == (plain / WEIGHTS).read_bytes()
    head = mx.load(str(install / MTP_HEAD))
    assert isinstance(head, dict) and all(n.startswith("mtp.") for n in head)
    if "moe" in name:
        assert head["mtp.layers.0.mlp.experts.gate_proj.weight"].shape == (8, 32, 64)
        assert head["mtp.layers.0.mlp.experts.down_proj.weight"].shape == (8, 64, 32)
    assert not any(n.startswith("mtp.") for n in mx.load(str(install / WEIGHTS)))  # type: ignore[union-attr]


def test_draft_logits_match_reference(runner: turbospark_core.Runner, refs: Any) -> None:
    got = runner.draft_logits(refs["prompt_ids"].tolist())
    want = refs["mtp_logits"]
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # the pre-norm convention (mlx-lm PR #990) is measurably different: we are not it
    assert np.abs(got - refs["mtp_logits_prenorm_variant"]).max() > 0.1


def test_bf16_weights(turbospark_install: Any, name: str, refs: Any) -> None:
    runner = turbospark_core.open(turbospark_install(name, "bf16"))
    got = runner.draft_logits(refs["prompt_ids"].tolist())
    assert np.abs(got - refs["mtp_logits_bf16_weights"]).max() <= TOL


def _prefilled(runner: turbospark_core.Runner, ids: list[int]) -> mtp.MtpDrafter:
    opened = runner.opened
    drafter = mtp.MtpDrafter(opened, mtp.load_head(opened), depth=3)
    residual = mtp.trunk_residual(opened, ids)
    drafter.observe(0, {drafter.capture_layers[0]: residual[0]})
    return drafter


def test_first_draft_after_prefill(runner: turbospark_core.Runner, refs: Any, greedy: list[int]) -> None:
    ids = refs["prompt_ids"].tolist()
    assert int(refs["mtp_draft_token"][0]) == greedy[0]
    drafter = _prefilled(runner, ids)
    slot = drafter._commit([*ids, greedy[0]])
    assert slot is not None
    assert np.abs(np.array(slot[0][0, -1]) - refs["mtp_draft_logits"]).max() <= TOL
    assert drafter.slots == len(ids)


def test_propose_chains_and_keeps_only_committed_slots(runner: turbospark_core.Runner, refs: Any) -> None:
    ids = refs["prompt_ids"].tolist()
    context = [*ids, int(refs["mtp_draft_token"][0])]
    drafter = _prefilled(runner, ids)
    draft = drafter.propose(context, 3, Sampler(SamplingParams()))
    assert len(draft.tokens) == 3 and draft.probs is None
    assert draft.tokens[0] == int(np.argmax(refs["mtp_draft_logits"]))
    assert drafter.slots == len(ids)  # the chained slots are dropped again
    # the chain equals feeding the head its own outputs by hand
    opened, head = runner.opened, drafter.head
    cache = mtp.new_head_cache(opened, head)
    h = head.trunk_hidden(mtp.trunk_residual(opened, ids))
    logits, out = head(h, mx.array([context[1:]]), cache)
    for token in draft.tokens[:2]:
        assert int(mx.argmax(logits[0, -1]).item()) == token
        logits, out = head(out[:, -1:], mx.array([[token]]), cache)
    assert int(mx.argmax(logits[0, -1]).item()) == draft.tokens[2]


def test_sampled_draft_gives_its_distribution(runner: turbospark_core.Runner, refs: Any) -> None:
    ids = refs["prompt_ids"].tolist()
    context = [*ids, int(refs["mtp_draft_token"][0])]
    drafter = _prefilled(runner, ids)
    params = SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3, seed=3)
    draft = drafter.propose(context, 2, Sampler(params))
    assert draft.probs is not None and draft.probs.shape == (2, refs["mtp_logits"].shape[1])
    probs = np.array(draft.probs)
    assert np.allclose(probs.sum(-1), 1.0, atol=1e-5) and (np.count_nonzero(probs, axis=-1) <= 20).all()
    assert all(probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    # row 0 is q = the request's transforms over the head's logits for the first slot
    sampler = Sampler(params)
    first = mx.array(refs["mtp_draft_logits"])[None]
    want = mx.exp(sampler.logprobs(sampler.penalize(first, mx.array(context[-params.repetition_context :]))))
    assert np.abs(probs[0] - np.array(want[0])).max() <= 1e-5


def test_rewind_after_rejected_drafts_equals_fresh(
    runner: turbospark_core.Runner, refs: Any, greedy: list[int]
) -> None:
    """Verify a draft whose tokens are wrong, accept one, rewind: the next draft logits are a fresh run's."""
    ids = refs["prompt_ids"].tolist()
    opened = runner.opened
    drafter = _prefilled(runner, ids[:-1])
    context = list(ids)
    drafter.propose(context, 3, Sampler(SamplingParams()))
    # a verify of [x_{n-1}, a, b, c] where only `a` is kept (whatever the drafter proposed)
    wrong = [greedy[0], 7, 9]
    residual = mtp.trunk_residual(opened, [*context, *wrong])
    drafter.observe(len(context) - 1, {drafter.capture_layers[0]: residual[0, len(context) - 1 :]})
    drafter.rewind(len(context) + 1 + 1)  # accepted greedy[0], bonus token greedy[1]
    committed = [*context, greedy[0], greedy[1]]
    slot = drafter._commit(committed)
    assert slot is not None
    fresh = runner.draft_logits(committed)
    assert np.abs(np.array(slot[0][0, -1]) - fresh[-1]).max() <= 1e-5
    # and back past the prompt: a rewind below the committed slots, then re-observed
    drafter.rewind(len(ids) - 5)
    back = ids[: len(ids) - 5]
    residual = mtp.trunk_residual(opened, back)
    drafter.observe(len(back) - 2, {drafter.capture_layers[0]: residual[0, len(back) - 2 :]})
    slot = drafter._commit(back)
    assert slot is not None
    assert np.abs(np.array(slot[0][0, -1]) - runner.draft_logits(back)[-1]).max() <= 1e-5


def test_more_than_one_head_layer_refused(turbospark_install: Any, tmp_path: Path) -> None:
    install = tmp_path / "install"
    shutil.copytree(turbospark_install("qwen3_5_mtp"), install)
    raw = json.loads((install / "manifest.json").read_text())
    raw["arch"]["mtp_num_hidden_layers"] = 2
    (install / "manifest.json").write_text(json.dumps(raw))
    runner = turbospark_core.open(install)
    with pytest.raises(ArchConfigError, match="mtp_num_hidden_layers=2"):
        runner.draft_logits([1, 2, 3])


def _per_expert_checkpoint(src: Path, dst: Path) -> Path:
    """The MoE fixture with the head's experts stored one by one (the Qwen3.5-35B-A3B release layout)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("bf16", "*.npz"))
    tensors = mx.load(str(dst / "model.safetensors"))
    assert isinstance(tensors, dict)
    gate_up = tensors.pop("mtp.layers.0.mlp.experts.gate_up_proj")
    down = tensors.pop("mtp.layers.0.mlp.experts.down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        prefix = f"mtp.layers.0.mlp.experts.{e}"
        tensors[f"{prefix}.gate_proj.weight"] = gate_up[e, :inter]
        tensors[f"{prefix}.up_proj.weight"] = gate_up[e, inter:]
        tensors[f"{prefix}.down_proj.weight"] = down[e]
    mx.save_safetensors(str(dst / "model.safetensors"), tensors)
    return dst


def test_per_expert_head_layout(turbospark_fixtures: Path, turbospark_install: Any, tmp_path: Path) -> None:
    src = _per_expert_checkpoint(turbospark_fixtures / "qwen3_5_moe_mtp", tmp_path / "hf")
    convert_checkpoint(src, tmp_path / "install")
    fused = Path(turbospark_install("qwen3_5_moe_mtp"))
    per_expert, stacked = mx.load(str(tmp_path / "install" / MTP_HEAD)), mx.load(str(fused / MTP_HEAD))
    assert isinstance(per_expert, dict) and isinstance(stacked, dict) and per_expert.keys() == stacked.keys()
    assert all(mx.array_equal(per_expert[n], stacked[n]).item() for n in stacked)
    refs = np.load(turbospark_fixtures / "qwen3_5_moe_mtp" / "references_mtp.npz")
    got = turbospark_core.open(tmp_path / "install").draft_logits(refs["prompt_ids"].tolist())
    assert np.abs(got - refs["mtp_logits"]).max() <= TOL


def test_quantized_head(turbospark_fixtures: Path, tmp_path: Path) -> None:
    """--quantize covers the head too; its quantization table travels in the 'mtp' section."""
    convert_checkpoint(turbospark_fixtures / "qwen3_5_mtp", tmp_path / "q8", quantize="q8")
    manifest = load_manifest(tmp_path / "q8")
    assert manifest.mtp is not None and "mtp.fc" in manifest.mtp["quantization"]
    assert not any(b.startswith("mtp.") for b in manifest.quantization)
    refs = np.load(turbospark_fixtures / "qwen3_5_mtp" / "references_mtp.npz")
    got = turbospark_core.open(tmp_path / "q8").draft_logits(refs["prompt_ids"].tolist())
    assert (got.argmax(-1) == refs["mtp_logits"].argmax(-1)).mean() > 0.9


def test_rotated_install_drops_the_head_and_refuses_mtp(turbospark_fixtures: Path, tmp_path: Path) -> None:
    convert_checkpoint(turbospark_fixtures / "qwen3_5_mtp", tmp_path / "rot", rotate=True)
    manifest = load_manifest(tmp_path / "rot")
    assert manifest.mtp is None and MTP_HEAD not in manifest.files
    for value in ("auto", 2):
        with pytest.raises(DrafterError, match=r"hadamard-folded .*mtp="):
            turbospark_core.open(tmp_path / "rot", mtp=value)


def _open_measured(path: Path) -> tuple[turbospark_core.Runner, int]:
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    runner = turbospark_core.open(path)
    return runner, mx.get_active_memory() - before


def test_plain_open_of_a_head_install_is_identical(turbospark_install: Any, name: str) -> None:
    """Without mtp, nothing of the head is read or allocated: same tensors, estimate and resident bytes."""
    _open_measured(Path(turbospark_install(name.removesuffix("_mtp"))))  # one-time allocations out of the way
    with_head, held = _open_measured(Path(turbospark_install(name)))
    plain, plain_held = _open_measured(Path(turbospark_install(name.removesuffix("_mtp"))))
    assert with_head.opened.index == plain.opened.index
    assert with_head.opened.estimate == plain.opened.estimate
    assert held == plain_held
    assert with_head.opened.manifest.files[WEIGHTS] == plain.opened.manifest.files[WEIGHTS]


def test_hook_build_mtp_head(runner: turbospark_core.Runner, refs: Any) -> None:
    """The hook, called through the family's hooks, builds the head over the trunk: one KV cache, shapes."""
    opened = runner.opened
    assert opened.hooks.has_mtp_head_flow()
    head = mtp.load_head(opened)  # FamilyHooks.build_mtp_head with a HeadContext over mtp.safetensors
    (spec,) = head.cache_layout()
    assert (spec.n_kv_heads, spec.head_dim) == (2, 32)
    hidden = head.trunk_hidden(mx.zeros((1, 3, 64)))
    logits, out = head(hidden, mx.array([[1, 2, 3]]), mtp.new_head_cache(opened, head))
    assert logits.shape == (1, 3, refs["mtp_logits"].shape[1]) and logits.dtype == mx.float32
    assert out.shape == (1, 3, 64)


def test_drafter_state_through_a_greedy_verify_loop(runner: turbospark_core.Runner, refs: Any) -> None:
    """A verify loop (the target re-run from scratch each step): at every step the slot the draft starts
    from equals a fresh computation, and the output is plain greedy's."""
    opened = runner.opened
    prompt = refs["prompt_ids"].tolist()
    drafter = mtp.MtpDrafter(opened, mtp.load_head(opened), depth=3)
    layer = drafter.capture_layers[0]
    drafter.observe(0, {layer: mtp.trunk_residual(opened, prompt)[0]})
    context = [*prompt, int(runner.logits(prompt)[-1].argmax())]
    greedy, drafted, accepted = Sampler(SamplingParams()), 0, 0
    while len(context) - len(prompt) < 24:
        slot = drafter._commit(context)
        assert slot is not None
        assert np.abs(np.array(slot[0][0, -1]) - runner.draft_logits(context)[-1]).max() <= 1e-5
        draft = drafter.propose(context, 3, greedy)
        n, seq = len(context), [*context, *draft.tokens]
        target = runner.logits(seq)[n - 1 :].argmax(-1)
        drafter.observe(n - 1, {layer: mtp.trunk_residual(opened, seq)[0, n - 1 :]})
        j = 0
        while j < len(draft.tokens) and draft.tokens[j] == int(target[j]):
            j += 1
        context = [*context, *draft.tokens[:j], int(target[j])]
        drafter.rewind(len(context))
        drafted, accepted = drafted + len(draft.tokens), accepted + j
    plain = runner.generate(prompt, max_tokens=24).tokens
    assert context[len(prompt) : len(prompt) + len(plain)] == plain
    assert drafted >= 3 * 8 and 0 <= accepted <= drafted


def test_open_mtp_makes_one_drafter_per_sequence(runner: turbospark_core.Runner) -> None:
    factory = mtp.open_mtp(runner.opened, "auto")
    assert isinstance(factory, mtp.MtpFactory)
    first, second = factory(), factory()
    assert isinstance(first, mtp.MtpDrafter) and first.depth == mtp.AUTO_DEPTH and first.name == "mtp"
    assert first.head is second.head and first._cache is not second._cache  # one head, a cache per sequence
    assert first.capture_layers == (runner.manifest.arch["num_hidden_layers"] - 1,)
    assert mtp.head_bytes(runner.opened) == (runner.manifest.root / MTP_HEAD).stat().st_size - _header(runner)


def _header(runner: turbospark_core.Runner) -> int:
    with (runner.manifest.root / MTP_HEAD).open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_with_mtp_is_plain_greedy(
    turbospark_install: Any, name: str, refs: Any, greedy: list[int], depth: int
) -> None:
    """64 greedy tokens through the speculative loop (recurrent state rewound after rejected drafts)."""
    install = turbospark_install(name)
    runner = turbospark_core.open(install, mtp=depth, num_draft_tokens=depth)
    assert runner.opened.drafter is not None and runner.opened.drafter.name == "mtp"
    ids = refs["prompt_ids"].tolist()
    plain = turbospark_core.open(install).generate(ids, max_tokens=64)
    out = runner.generate(ids, max_tokens=64)
    assert len(plain.tokens) == 64 and out.tokens == plain.tokens and out.tokens[:16] == greedy
    assert out.stats.draft_tokens >= 64 // (depth + 1) and 0 <= out.stats.accepted_tokens <= out.stats.draft_tokens
    # draft_logits uses the open's head
    assert np.abs(runner.draft_logits(ids) - refs["mtp_logits"]).max() <= TOL


def test_rows_decoding_together_draft_with_the_head_and_verify_together(
    turbospark_install: Any, name: str, refs: Any
) -> None:
    """Batched: each row's head reads its own rows of the batched forward's residual; lossless with the
    recurrent rows rewound to the step's start and caught up in the next forward."""
    install = turbospark_install(name)
    ids = refs["prompt_ids"].tolist()
    prompts = [ids, ids[3:], ids[:25] * 2]
    limits = [24, 10, 12]
    plain = turbospark_core.open(install)
    want = [plain.generate(p, m).tokens for p, m in zip(prompts, limits, strict=True)]
    got = turbospark_core.open(install, mtp=2, num_draft_tokens=2).generate_many(prompts, limits)
    assert [g.tokens for g in got] == want
    assert all(g.stats.draft_tokens > 0 for g in got[1:])  # verified beside the longest row


def test_session_prefix_reuse_with_mtp(turbospark_install: Any, name: str, refs: Any) -> None:
    """A second turn reuses the session's cache; the head starts again after the reused prefix, losslessly."""
    install = turbospark_install(name)
    ids = refs["prompt_ids"].tolist()
    runner = turbospark_core.open(install, mtp=2, num_draft_tokens=2)
    session = runner.session("s")
    first = session.generate(ids[:30], max_tokens=8)
    turn = [*ids[:30], *first.tokens, *ids[30:40]]
    second = session.generate(turn, max_tokens=24)
    assert second.stats.reused_tokens > 0 and second.stats.draft_tokens > 0
    assert second.tokens == turbospark_core.open(install).generate(turn, max_tokens=24).tokens


def test_dedicated_head_embedding(turbospark_fixtures: Path, tmp_path: Path) -> None:
    """``mtp_use_dedicated_embeddings``: the head reads its own ``mtp.embed_tokens`` (here a shifted copy)."""
    src = tmp_path / "hf"
    shutil.copytree(turbospark_fixtures / "qwen3_5_mtp", src, ignore=shutil.ignore_patterns("bf16", "*.npz"))
    tensors = mx.load(str(src / "model.safetensors"))
    assert isinstance(tensors, dict)
    trunk = tensors["model.language_model.embed_tokens.weight"]
    tensors["mtp.embed_tokens.weight"] = mx.roll(trunk, 1, axis=0)  # head row t = trunk row t - 1
    mx.save_safetensors(str(src / "model.safetensors"), tensors)
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["mtp_use_dedicated_embeddings"] = True
    (src / "config.json").write_text(json.dumps(config))
    convert_checkpoint(src, tmp_path / "install")
    refs = np.load(turbospark_fixtures / "qwen3_5_mtp" / "references_mtp.npz")
    ids = refs["prompt_ids"].tolist()
    runner = turbospark_core.open(tmp_path / "install")
    assert runner.manifest.arch["mtp_use_dedicated_embeddings"] is True
    # the head embeds x + 1 as the trunk's table embeds x: slot logits equal the reference's for shifted tokens
    trunk_h = mtp.trunk_residual(runner.opened, ids)
    head = mtp.load_head(runner.opened)
    shifted = [(t + 1) % trunk.shape[0] for t in ids[1:]]
    logits, _ = head(head.trunk_hidden(trunk_h)[:, :-1], mx.array([shifted]), mtp.new_head_cache(runner.opened, head))
    assert np.abs(np.array(logits[0]) - refs["mtp_logits"]).max() <= TOL


def test_cli_generate_with_mtp(turbospark_install: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from turbospark_core.cli import main

    install = str(turbospark_install("qwen3_5_mtp"))
    assert main(["generate", install, "hello", "--max-tokens", "12", "--mtp", "2"]) == 0
    with_mtp = capsys.readouterr().out
    assert main(["generate", install, "hello", "--max-tokens", "12"]) == 0
    assert capsys.readouterr().out == with_mtp


def test_draft_cost_counts_the_head_and_the_output_head_it_reuses(runner: turbospark_core.Runner) -> None:
    opened = runner.opened
    arch = opened.manifest.arch
    output_head = arch["vocab_size"] * arch["hidden_size"] * 4  # float32 install
    assert mtp.draft_cost(opened) == pytest.approx((mtp.head_bytes(opened) + output_head) / opened.estimate.weights)


def test_long_pause_in_drafting_merges_hiddens(
    runner: turbospark_core.Runner, refs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Observed one position at a time (drafting paused), the drafter still drafts exactly afterwards."""
    monkeypatch.setattr(mtp, "MAX_PARTS", 8)
    opened = runner.opened
    ids = refs["prompt_ids"].tolist()
    drafter = mtp.MtpDrafter(opened, mtp.load_head(opened), depth=1)
    residual = mtp.trunk_residual(opened, ids)[0]
    for t in range(len(ids)):
        drafter.observe(t, {drafter.capture_layers[0]: residual[t : t + 1]})
        assert len(drafter._parts) <= 8
    slot = drafter._commit([*ids, int(refs["mtp_draft_token"][0])])
    assert slot is not None
    assert np.abs(np.array(slot[0][0, -1]) - refs["mtp_draft_logits"]).max() <= TOL


def test_cli_inspect_names_the_mtp_drafter(turbospark_install: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from turbospark_core.cli import main

    install = str(turbospark_install("qwen3_5_mtp"))
    assert main(["inspect", install, "--mtp", "2"]) == 0
    out = capsys.readouterr().out
    assert "multi-token-prediction head, up to 2 tokens per verify" in out and "mtp.safetensors" in out


def test_mtp_over_the_memory_budget_is_refused_naming_the_head(turbospark_install: Any) -> None:
    install = turbospark_install("qwen3_5_mtp")
    need = turbospark_core.open(install, max_context=256).opened.estimate.total
    turbospark_core.open(install, max_context=256, memory_budget=need)  # plain: fits exactly
    with pytest.raises(MemoryBudgetError, match=r"mtp needs .* MTP head"):
        turbospark_core.open(install, max_context=256, memory_budget=need, mtp=1)
    with_head = turbospark_core.open(install, max_context=256, mtp=1).opened.estimate
    assert with_head.drafter > 0 and with_head.total == need + with_head.drafter  # the head joins the estimate
    turbospark_core.open(install, max_context=256, memory_budget=with_head.total, mtp=1)  # fits exactly


def test_sampled_generation_with_mtp_is_seeded(turbospark_install: Any, refs: Any, name: str) -> None:
    """Speculative sampling with the head's q: drafts are proposed and verified, and a seed reproduces the run."""
    runner = turbospark_core.open(turbospark_install(name), mtp=2, num_draft_tokens=2)
    ids = refs["prompt_ids"].tolist()
    options = {"temperature": 0.9, "top_p": 0.95, "repetition_penalty": 1.1, "seed": 11}
    first = runner.generate(ids, max_tokens=24, **options)
    again = runner.generate(ids, max_tokens=24, **options)
    assert first.tokens == again.tokens and len(first.tokens) == 24
    assert first.stats.draft_tokens > 0
