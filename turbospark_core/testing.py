"""The conformance harness every family plugin runs (a pytest plugin shipped in the package).

A plugin's test module subclasses :class:`FamilyConformance` and names the
reference fixtures it serves::

    from turbospark_core.testing import FamilyConformance

    class TestLlama(FamilyConformance):
        fixtures = ("llama", "qwen3")

Each ``test_*`` method below then runs once per fixture. A fixture is a
directory with a Hugging Face checkpoint, a ``bf16/`` copy and
``references.npz`` (see ``shared/fixtures/README.md``). The root holding
them comes from ``--turbospark-fixtures``, ``$TURBOSPARK_FIXTURES``, or the
nearest ``shared/fixtures`` beside or above the test root.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import pytest

FLOAT32_REL_TOL = 1e-4
BF16_ARGMAX_AGREEMENT = 0.95
INCREMENTAL_ABS_TOL = 1e-4


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--turbospark-fixtures",
        default=None,
        help="directory holding turbospark reference fixtures (default: nearest shared/fixtures)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: real-model or long tests")


def find_fixtures_root(config: pytest.Config) -> Path:
    """Where the reference fixtures live (option, env var, or nearest shared/fixtures)."""
    explicit = config.getoption("--turbospark-fixtures") or os.environ.get("TURBOSPARK_FIXTURES")
    if explicit:
        return Path(explicit)
    start = Path(str(config.rootpath)).resolve()
    for parent in [start, *start.parents]:
        for candidate in (parent / "shared" / "fixtures", parent.parent / "shared" / "fixtures"):
            if candidate.is_dir():
                return candidate
    msg = "turbospark reference fixtures not found; pass --turbospark-fixtures DIR or set TURBOSPARK_FIXTURES"
    raise pytest.UsageError(msg)


@pytest.fixture(scope="session")
def turbospark_fixtures(request: pytest.FixtureRequest) -> Path:
    """The root directory of the reference fixtures."""
    return find_fixtures_root(request.config)


@pytest.fixture(scope="session")
def turbospark_install(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """``make(fixture_name, variant, root=None)`` -> path of an install converted once per session.

    ``variant`` is ``"float32"`` (the checkpoint as is) or ``"bf16"`` (its
    ``bf16/`` copy). ``root`` defaults to the shared fixtures root; the
    conformance tests pass their (overridable) ``turbospark_fixtures``.
    """
    from turbospark_core.convert import convert

    made: dict[tuple[Path, str, str], Path] = {}
    default_root = find_fixtures_root(request.config)

    def make(name: str, variant: str = "float32", root: Path | None = None) -> Path:
        key = (root or default_root, name, variant)
        if key not in made:
            src = key[0] / name / ("bf16" if variant == "bf16" else "")
            dst = tmp_path_factory.mktemp(f"{name}-{variant}") / "install"
            convert(src, dst)
            made[key] = dst
        return made[key]

    return make


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cls = metafunc.cls
    if cls is not None and issubclass(cls, FamilyConformance) and "fixture_name" in metafunc.fixturenames:
        metafunc.parametrize("fixture_name", list(cls.fixtures))


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max|got - ref| / max|ref|."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


class FamilyConformance:
    """Checks every family plugin inherits: parity, caching, independence, hook contract."""

    fixtures: ClassVar[tuple[str, ...]] = ()
    float32_rel_tol: ClassVar[float] = FLOAT32_REL_TOL
    bf16_argmax_agreement: ClassVar[float] = BF16_ARGMAX_AGREEMENT

    # ------------------------------------------------------------ helpers
    @pytest.fixture
    def refs(self, turbospark_fixtures: Path, fixture_name: str) -> Any:
        return np.load(turbospark_fixtures / fixture_name / "references.npz")

    @pytest.fixture
    def install(self, turbospark_install: Any, turbospark_fixtures: Path, fixture_name: str) -> Any:
        """``install(variant)`` -> this fixture's install, from this class's fixtures root."""
        return lambda variant="float32": turbospark_install(fixture_name, variant, root=turbospark_fixtures)

    @pytest.fixture
    def runner(self, install: Any) -> Any:
        import turbospark_core

        return turbospark_core.open(install("float32"))

    @pytest.fixture
    def bf16_runner(self, install: Any) -> Any:
        import turbospark_core

        return turbospark_core.open(install("bf16"))

    # ------------------------------------------------------------ parity
    def test_float32_logits_match_reference(self, runner: Any, refs: Any) -> None:
        got = runner.logits(refs["prompt_ids"].tolist())
        assert got.shape == refs["logits"].shape and got.dtype == np.float32
        assert relative_error(got, refs["logits"]) <= self.float32_rel_tol

    def test_float32_greedy_matches_reference(self, runner: Any, refs: Any) -> None:
        prompt = refs["prompt_ids"].tolist()
        want = refs["greedy_tokens"].tolist()
        gen = runner.generate(prompt, max_tokens=len(want), temperature=0.0)
        eos = runner.eos_token_ids
        expected = [t for t in want[: next((i for i, t in enumerate(want) if t in eos), len(want))]]
        assert gen.tokens == expected
        steps = runner.logits(prompt + want[:-1])[len(prompt) - 1 :]
        assert relative_error(steps, refs["greedy_step_logits"]) <= self.float32_rel_tol

    def test_bf16_weights_agree_with_reference(self, bf16_runner: Any, refs: Any) -> None:
        got = bf16_runner.logits(refs["prompt_ids"].tolist())
        ref = refs["logits_bf16_weights"]
        agreement = float((got.argmax(-1) == ref.argmax(-1)).mean())
        assert agreement >= self.bf16_argmax_agreement, f"argmax agreement {agreement:.3f}"

    # ------------------------------------------------------------ caching
    def test_incremental_decoding_equals_full_forward(self, runner: Any, refs: Any) -> None:
        ids = refs["prompt_ids"].tolist()
        model, opened = runner.model, runner.opened
        full = np.array(model(mx.array([ids]))[0])
        cache = opened.new_cache()
        half = len(ids) // 2
        parts = [np.array(model(mx.array([ids[:half]]), cache)[0])]
        parts += [np.array(model(mx.array([[t]]), cache)[0]) for t in ids[half:]]
        incremental = np.concatenate(parts)
        assert np.abs(incremental - full).max() <= INCREMENTAL_ABS_TOL * max(1.0, np.abs(full).max())

    def test_fresh_context_independence(self, runner: Any, refs: Any) -> None:
        ids = refs["prompt_ids"].tolist()
        first = runner.logits(ids)
        runner.generate(ids[::-1], max_tokens=4)
        runner.logits(ids[: len(ids) // 3])
        assert np.array_equal(first, runner.logits(ids))

    def test_batch_rows_are_independent(self, runner: Any, refs: Any) -> None:
        ids = refs["prompt_ids"].tolist()
        other = ids[::-1]
        batch = np.array(runner.model(mx.array([ids, other]), runner.opened.new_cache()))
        assert batch.shape[:2] == (2, len(ids))
        assert np.abs(batch[0] - runner.logits(ids)).max() <= 1e-4 * np.abs(batch[0]).max()
        assert np.abs(batch[1] - runner.logits(other)).max() <= 1e-4 * np.abs(batch[1]).max()

    def test_session_prefix_reuse_matches_fresh_run(self, runner: Any, refs: Any) -> None:
        from turbospark_core.sessions import SequenceState

        ids = refs["prompt_ids"].tolist()
        session = runner.session("conformance")
        session.reset()
        session.generate(ids[: len(ids) // 2], max_tokens=3)
        reused = session.generate(ids, max_tokens=6)
        assert reused.stats.reused_tokens > 0
        assert reused.tokens == runner.generate(ids, max_tokens=6).tokens
        # logits level: a parked state rewound and extended equals a fresh prefill, bit for bit
        state = SequenceState(runner.opened.new_cache)
        fresh = np.array(runner._prefill(ids, state.caches))
        parked = runner.sessions.acquire("conformance")
        kept = parked.rewind(len(ids) // 2)
        assert kept > 0
        again = np.array(runner._prefill(ids[kept:], parked.caches))
        assert np.abs(again - fresh).max() <= INCREMENTAL_ABS_TOL * max(1.0, np.abs(fresh).max())
        session.reset()

    def test_layer_count(self, runner: Any) -> None:
        assert len(runner.model.layers) == runner.manifest.arch["num_hidden_layers"]

    # ------------------------------------------------------------ hook contract
    def test_hooks_answer_none_for_foreign_arch(self, runner: Any) -> None:
        from turbospark_core import plugins

        foreign = {**runner.manifest.arch, "model_type": "__not_a_family__"}
        hooks = plugins.family_hooks(runner.manifest.model_type)
        assert hooks.build_family_state(_foreign_context(runner, foreign)) is None
        assert hooks.cache_layout(foreign) is None
        assert plugins.pm.hook.arch_problems(arch=foreign) is None
        assert plugins.pm.hook.steering_supported(arch=foreign) is None
        assert plugins.pm.hook.accepts_hadamard(arch=foreign) is None
        assert plugins.pm.hook.hf_tensor_target(arch=foreign, name="model.norm.weight") is None

    def test_probes_return_bool(self, runner: Any) -> None:
        from turbospark_core import plugins

        arch = runner.manifest.arch
        hooks = plugins.family_hooks(arch["model_type"])
        assert isinstance(plugins.pm.hook.steering_supported(arch=arch), bool)
        assert isinstance(plugins.pm.hook.accepts_hadamard(arch=arch), bool)
        assert hooks.arch_problems(arch) == []
        assert 0 < len(hooks.cache_layout(arch)) <= arch["num_hidden_layers"]

    def test_invalid_arch_is_refused_by_name(self, install: Any, tmp_path: Path) -> None:
        import json
        import shutil

        import turbospark_core
        from turbospark_core.errors import ArchConfigError

        src = install("float32")
        bad = tmp_path / "bad"
        shutil.copytree(src, bad)
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["arch"]["num_hidden_layers"] = 0
        (bad / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArchConfigError, match="num_hidden_layers"):
            turbospark_core.open(bad)


def _foreign_context(runner: Any, arch: dict[str, Any]) -> Any:
    from turbospark_core.context import FamilyContext

    opened = runner.opened
    return FamilyContext(
        arch=arch,
        weights=None,  # a foreign family must not touch it
        cache_layout=opened.cache_layout,
        compute_dtype=opened.policy.compute_dtype,
    )
