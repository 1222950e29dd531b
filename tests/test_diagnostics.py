"""Router and FFN histograms: exact totals, identical outputs, plain objects when off, refusals by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core import diagnostics, plugins
from turbospark_core.diagnostics import (
    CENTRE,
    FFN_BINS,
    Diagnostics,
    ObservedExperts,
    ObservedLinear,
    Tally,
    UncompiledModel,
    ffn_bins,
    ffn_edges,
)
from turbospark_core.errors import OptionError
from turbospark_core.experts.streamed import StreamedExpertBank
from turbospark_core.layers import ExpertBank, Linear
from turbospark_core.weights import WeightStore

# MoE fixtures and the arch keys of their routed layers: (top_k, expert intermediate size)
MOE = {
    "qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size"),
    "minimax_m2": ("num_experts_per_tok", "intermediate_size"),
    "qwen3_5_moe": ("num_experts_per_tok", "moe_intermediate_size"),
    "gemma4_moe": ("top_k_experts", "moe_intermediate_size"),
    "gpt_oss": ("num_experts_per_tok", "intermediate_size"),
}


def _config(fixtures: Path, name: str) -> dict[str, Any]:
    path = fixtures / name / "config.json"
    if not path.is_file():
        pytest.skip(f"reference fixture {path} is not available")
    config = json.loads(path.read_text())
    if not plugins.registry().serves(config["model_type"]):
        pytest.skip(f"no installed plugin serves {config['model_type']!r}")
    return config.get("text_config", config)


@pytest.fixture(scope="module")
def fixtures(turbospark_fixtures: Path) -> Path:
    return turbospark_fixtures


@pytest.fixture(scope="module")
def prompt(fixtures: Path) -> list[int]:
    with np.load(fixtures / "qwen3_moe" / "references.npz") as refs:
        return [int(t) for t in refs["prompt_ids"][:12]]


def _ids(config: dict[str, Any], n: int = 10) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(3, config["vocab_size"], n)]


# ------------------------------------------------------------------ router histogram
@pytest.mark.parametrize("name", sorted(MOE))
def test_router_counts_sum_to_tokens_times_top_k(name: str, fixtures: Path, turbospark_install: Any) -> None:
    config = _config(fixtures, name)
    runner = turbospark_core.open(turbospark_install(name), router_histogram=True)
    ids = _ids(config)
    runner.logits(ids)
    h = runner.router_histogram()
    k = config[MOE[name][0]]
    assert len(h.layers) > 0 and (h.top_k == k).all() and (h.tokens == len(ids)).all()
    np.testing.assert_array_equal(h.counts.sum(axis=1), len(ids) * k)
    assert (h.counts >= 0).all() and h.counts.shape[1] == runner.opened.experts.layout.max_experts
    assert np.isfinite(h.weight_mass).all() and (h.weight_mass >= 0).all()  # every family passes its weights
    assert ((h.counts > 0) | (h.weight_mass == 0)).all()  # mass only where chosen


def test_weight_mass_of_normalised_top_k_is_one_per_token(fixtures: Path, turbospark_install: Any) -> None:
    config = _config(fixtures, "qwen3_moe")
    assert config["norm_topk_prob"]
    runner = turbospark_core.open(turbospark_install("qwen3_moe"), router_histogram=True)
    runner.logits(_ids(config, 9))
    np.testing.assert_allclose(runner.router_histogram().weight_mass.sum(axis=1), 9, rtol=1e-5)


def test_generation_counts_every_token_it_runs(prompt: list[int], turbospark_install: Any, fixtures: Path) -> None:
    config = _config(fixtures, "qwen3_moe")
    runner = turbospark_core.open(turbospark_install("qwen3_moe"), router_histogram=True, warmup=True)
    assert (runner.router_histogram().counts == 0).all()  # the warm-up token is forgotten
    gen = runner.generate(prompt, max_tokens=6, temperature=0.0)
    assert gen.finish_reason == "length"
    h = runner.router_histogram(reset=True)
    tokens = len(prompt) + 5  # the last token produced is never fed back
    np.testing.assert_array_equal(h.tokens, tokens)
    np.testing.assert_array_equal(h.counts.sum(axis=1), tokens * config["num_experts_per_tok"])
    assert (runner.router_histogram().counts == 0).all() and (runner.router_histogram().tokens == 0).all()


def test_streamed_counts_equal_resident_and_report_slot_hits(prompt: list[int], turbospark_install: Any) -> None:
    install = turbospark_install("qwen3_moe")
    opts = {"router_histogram": True, "ffn_histogram": True}
    resident = turbospark_core.open(install, residency="resident", **opts)
    streamed = turbospark_core.open(install, residency="streamed", expert_slots=3, **opts)
    assert streamed.opened.experts.plan.residency == "streamed"
    a = resident.generate(prompt, max_tokens=5, temperature=0.0)
    b = streamed.generate(prompt, max_tokens=5, temperature=0.0)
    assert a.tokens == b.tokens
    ha, hb = resident.router_histogram(), streamed.router_histogram()
    np.testing.assert_array_equal(ha.counts, hb.counts)
    np.testing.assert_allclose(ha.weight_mass, hb.weight_mass, rtol=1e-6)
    np.testing.assert_array_equal(resident.ffn_histogram().counts, streamed.ffn_histogram().counts)
    assert ha.residency == "resident" and np.isnan(ha.hit_rate).all() and (ha.hits == 0).all()
    assert hb.residency == "streamed" and (hb.misses > 0).all()
    assert ((hb.hit_rate >= 0) & (hb.hit_rate <= 1)).all()
    stats = streamed.expert_stats()  # per-layer hits and misses add up to the store's totals
    assert (int(hb.hits.sum()), int(hb.misses.sum())) == (stats.hits, stats.misses)


# ------------------------------------------------------------------ FFN histogram
def test_ffn_totals_dense(fixtures: Path, turbospark_install: Any) -> None:
    config = _config(fixtures, "llama")
    runner = turbospark_core.open(turbospark_install("llama"), ffn_histogram=True)
    ids = _ids(config, 11)
    runner.logits(ids)
    f = runner.ffn_histogram()
    assert list(f.layers) == list(range(config["num_hidden_layers"]))
    assert f.counts.shape == (config["num_hidden_layers"], FFN_BINS) and len(f.edges) == FFN_BINS + 1
    np.testing.assert_array_equal(f.counts.sum(axis=1), len(ids) * config["intermediate_size"])


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_ffn_totals_moe(name: str, fixtures: Path, turbospark_install: Any) -> None:
    config = _config(fixtures, name)
    runner = turbospark_core.open(turbospark_install(name), ffn_histogram=True)
    ids = _ids(config, 7)
    runner.logits(ids)
    k, width = (config[key] for key in MOE[name])
    np.testing.assert_array_equal(runner.ffn_histogram().counts.sum(axis=1), len(ids) * k * width)


def test_ffn_bins_follow_the_edges() -> None:
    values = np.array([0.0, 5e-5, -5e-5, 1.5e-4, -1.5e-4, 0.3, -0.3, 1.1, 999.0, 5e3, -1e9, 2.5e-2], np.float32)
    got = np.array(ffn_bins(mx.array(values)))
    want = np.searchsorted(ffn_edges(), values.astype(np.float64), side="right") - 1
    np.testing.assert_array_equal(got, want)
    assert got[0] == CENTRE and got[-3] == FFN_BINS - 1 and got[-2] == 0
    np.testing.assert_array_equal(np.array(ffn_bins(mx.array(-values))), 2 * CENTRE - got)  # mirrored


def test_tally_folds_before_int32_could_wrap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(diagnostics, "_FOLD_AT", 5)
    monkeypatch.setattr(diagnostics, "_FLUSH_EVERY", 2)
    tally = Tally(4, mx.int32)
    for _ in range(7):
        tally.add(mx.array([0, 1, 1, 3]), 1, 4)
    np.testing.assert_array_equal(tally.read(), [7, 14, 0, 7])
    assert tally.read().dtype == np.int64


# ------------------------------------------------------------------ identical outputs, plain objects when off
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_outputs_are_unchanged_by_diagnostics(name: str, fixtures: Path, turbospark_install: Any) -> None:
    config = _config(fixtures, name)
    install = turbospark_install(name)
    plain = turbospark_core.open(install)
    observed = turbospark_core.open(install, ffn_histogram=True, router_histogram=name != "llama")
    ids = _ids(config, 8)
    np.testing.assert_array_equal(plain.logits(ids), observed.logits(ids))
    assert plain.generate(ids, 6, temperature=0.0).tokens == observed.generate(ids, 6, temperature=0.0).tokens


def _mlp_objects(runner: Any) -> list[Any]:
    out = []
    for block in runner.model.layers:
        mlp = block.mlp
        out.append(getattr(mlp, "experts", None) or mlp.down_proj)
    return out


@pytest.mark.parametrize("residency", ["resident", "streamed"])
def test_off_means_plain_objects(residency: str, turbospark_install: Any, fixtures: Path) -> None:
    _config(fixtures, "qwen3_moe")
    moe = turbospark_core.open(turbospark_install("qwen3_moe"), residency=residency, expert_slots=4)
    dense = turbospark_core.open(turbospark_install("llama"))
    for runner in (moe, dense):
        assert runner.opened.diagnostics is None
        assert not isinstance(runner.model, UncompiledModel) and runner.model is runner.opened.model
    bank = StreamedExpertBank if residency == "streamed" else ExpertBank
    assert all(type(e) is bank for e in _mlp_objects(moe))
    assert all(type(d) is Linear for d in _mlp_objects(dense))
    with pytest.raises(OptionError, match="open the install with router_histogram=True"):
        moe.router_histogram()
    with pytest.raises(OptionError, match="open the install with ffn_histogram=True"):
        dense.ffn_histogram()


def test_on_wraps_in_the_core(turbospark_install: Any, fixtures: Path) -> None:
    _config(fixtures, "qwen3_moe")
    moe = turbospark_core.open(turbospark_install("qwen3_moe"), router_histogram=True)
    dense = turbospark_core.open(turbospark_install("llama"), ffn_histogram=True)
    assert isinstance(moe.model, UncompiledModel) and isinstance(dense.model, UncompiledModel)
    assert all(type(e) is ObservedExperts and e.ffn is None for e in _mlp_objects(moe))
    assert all(type(d) is ObservedLinear for d in _mlp_objects(dense))
    with pytest.raises(OptionError, match="ffn_histogram=True"):  # each read needs its own option
        moe.ffn_histogram()


# ------------------------------------------------------------------ refusals
def test_router_histogram_on_a_dense_model_is_refused_by_name(turbospark_install: Any, names: Callable) -> None:
    with pytest.raises(OptionError) as err:
        turbospark_core.open(turbospark_install("llama"), router_histogram=True)
    names(err, "router_histogram=True", "'llama'", "no routed experts", "open without router_histogram")


def test_ffn_histogram_that_observes_nothing_is_refused_by_name(names: Callable) -> None:
    d = Diagnostics(router=False, ffn=True)
    with pytest.raises(OptionError) as err:
        d.attach(object(), "strange", None)  # type: ignore[arg-type]
    names(err, "ffn_histogram=True", "'strange'", "down_proj", "open without ffn_histogram")


@pytest.mark.parametrize("option", ["router_histogram", "ffn_histogram"])
def test_non_boolean_flags_are_refused(option: str, turbospark_install: Any, names: Callable) -> None:
    with pytest.raises(OptionError) as err:
        turbospark_core.open(turbospark_install("llama"), **{option: "yes"})
    names(err, f"{option}='yes'", "True or False")


def test_observed_weights_keep_the_store_contract(turbospark_install: Any) -> None:
    runner = turbospark_core.open(turbospark_install("llama"), ffn_histogram=True)
    down = runner.model.layers[0].mlp.down_proj
    assert isinstance(down.inner, Linear) and down.weight is down.inner.weight
    assert issubclass(diagnostics.ObservedWeights, WeightStore)
