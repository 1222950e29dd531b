"""The conformance harness every family plugin runs (a pytest plugin shipped in the package).

Load it on request, in the ``conftest.py`` at your test root::

    pytest_plugins = ["turbospark_core.testing"]

(or ``pytest -p turbospark_core.testing``). Then subclass one of two classes.

:class:`FamilyConformance` checks a family against reference fixtures::

    from turbospark_core.testing import FamilyConformance

    class TestLlama(FamilyConformance):
        fixtures = ("llama", "qwen3")

Each ``test_*`` method runs once per fixture. A fixture is a directory with a
Hugging Face checkpoint, a ``bf16/`` copy and ``references.npz`` (see
``shared/fixtures/README.md``). The root holding them comes from
``--turbospark-fixtures``, ``$TURBOSPARK_FIXTURES``, or the nearest
``shared/fixtures`` beside or above the test root.

:class:`TinyRandomConformance` needs no reference files: it writes a tiny
Hugging Face checkpoint with random weights from each config dict in
``tiny_configs``, converts it with :func:`turbospark_core.convert.convert`, and
runs the structural checks (the install opens, logits have the right shape,
incremental decoding equals the full forward, sessions, the hook contract,
steering: scale 0 is bit-identical to none, an ablated residual has no
component along the direction, each request gets its own edit; compiled
one-token steps equal uncompiled ones and never retrace)::

    class TestMyFamilySmoke(TinyRandomConformance):
        tiny_configs = {"tiny": {"model_type": "my_llama", "hidden_size": 64, ...}}

Every check uses the public API only (``Runner.logits``, ``Runner.model``,
sessions, :class:`turbospark_core.plugins.FamilyHooks`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import pytest

FLOAT32_REL_TOL = 1e-4
BF16_ARGMAX_AGREEMENT = 0.95
INCREMENTAL_ABS_TOL = 1e-4
STEERING_ABS_TOL = 1e-4  # max |logit - steering.npz reference| (the fixtures README's suggestion)
ABLATION_REL_TOL = 1e-5  # |h . d^| / |h| left in a captured residual after ablation
DECODE_STEPS = 4  # one-token steps the compiled-decode checks run (a ring of window 16 wraps in the 48-token prompt)


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

    ``variant`` is ``"float32"`` (the checkpoint as is), ``"bf16"`` (its
    ``bf16/`` copy) or ``"q4"`` (the checkpoint with its matrices quantized to
    4 bits). ``root`` defaults to the shared fixtures root; the conformance
    tests pass their (overridable) ``turbospark_fixtures``.
    """
    from turbospark_core.convert import convert

    made: dict[tuple[Path, str, str], Path] = {}
    default_root = find_fixtures_root(request.config)

    def make(name: str, variant: str = "float32", root: Path | None = None) -> Path:
        key = (root or default_root, name, variant)
        if key not in made:
            src = key[0] / name / ("bf16" if variant == "bf16" else "")
            dst = tmp_path_factory.mktemp(f"{name}-{variant}") / "install"
            convert(src, dst, quantize="q4" if variant == "q4" else None)
            made[key] = dst
        return made[key]

    return make


@pytest.fixture(scope="session")
def turbospark_vision_install(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Any:
    """``make(fixture_name, variant="float32")`` -> ``(trunk install, vision sidecar)``, converted once per session.

    The trunk as ``turbospark convert SRC DST`` writes it, the sidecar as ``--vision SIDECAR`` does.
    """
    from turbospark_core.convert import convert
    from turbospark_core.vision.convert import convert_sidecar

    made: dict[tuple[str, str], tuple[Path, Path]] = {}
    root = find_fixtures_root(request.config)

    def make(name: str, variant: str = "float32") -> tuple[Path, Path]:
        if (name, variant) not in made:
            src = root / name / ("bf16" if variant == "bf16" else "")
            work = tmp_path_factory.mktemp(f"{name}-{variant}-vision")
            convert(src, work / "install")
            convert_sidecar(src, work / "sidecar")
            made[name, variant] = (work / "install", work / "sidecar")
        return made[name, variant]

    return make


def vision_messages(prompt: str, markup: str, images: Sequence[Any]) -> list[dict[str, Any]]:
    """The one user message a ``references_vision.npz`` ``<case>_prompt`` renders from (fixtures README).

    Args:
        prompt: The stored prompt (``<|bos|><|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n``).
        markup: What the template renders per image (``<|vision_start|><|image_pad|><|vision_end|>``, ``<|image|>``).
        images: The images, in order (paths, arrays...).
    """
    head, tail = "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"
    content = prompt[prompt.index(head) + len(head) : prompt.rindex(tail)]
    texts = content.split(markup)
    if len(texts) != len(images) + 1:
        msg = f"the prompt holds {len(texts) - 1} image(s), {len(images)} given"
        raise ValueError(msg)
    parts: list[dict[str, Any]] = []
    for i, text in enumerate(texts):
        if text:
            parts.append({"type": "text", "text": text})
        if i < len(images):
            parts.append({"type": "image", "image": images[i]})
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="session")
def turbospark_tiny_install(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``make(name, hf_config, tensors, variant="float32")`` -> path of a tiny random install, converted once.

    ``tensors`` maps each Hugging Face tensor name to its shape (see
    :func:`llama_tensor_shapes`); see :func:`write_tiny_checkpoint`.
    ``variant="q4"``: the same checkpoint with its matrices quantized to 4 bits.
    """
    from turbospark_core.convert import convert

    made: dict[str, Path] = {}

    def make(
        name: str, hf_config: Mapping[str, Any], tensors: Mapping[str, Sequence[int]], variant: str = "float32"
    ) -> Path:
        key = json.dumps([name, hf_config, {k: list(v) for k, v in tensors.items()}, variant], sort_keys=True)
        if key not in made:
            work = tmp_path_factory.mktemp(f"tiny-{name}-{variant}")
            hf = write_tiny_checkpoint(work / "hf", hf_config, tensors)
            convert(hf, work / "install", quantize="q4" if variant == "q4" else None)
            made[key] = work / "install"
        return made[key]

    return make


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cls = metafunc.cls
    if cls is not None and issubclass(cls, StructuralChecks) and "fixture_name" in metafunc.fixturenames:
        metafunc.parametrize("fixture_name", cls.fixture_names())


def chi_square(counts: Mapping[Any, int], expected: Mapping[Any, float], n: int) -> tuple[float, float]:
    """Pearson's statistic of ``n`` draws' ``counts`` against the ``expected`` probabilities, and the value a
    correct sampler exceeds with probability ~0.001 (Wilson-Hilferty); cells expecting fewer than 5 draws
    are pooled into one (left out when it expects fewer than 5 too)."""
    cells = [c for c in expected if expected[c] * n >= 5]
    stat = sum((counts.get(c, 0) - n * expected[c]) ** 2 / (n * expected[c]) for c in cells)
    rest_p, dof = 1.0 - sum(expected[c] for c in cells), len(cells) - 1
    if rest_p * n >= 5:
        rest = n - sum(counts.get(c, 0) for c in cells)
        stat += (rest - n * rest_p) ** 2 / (n * rest_p)
        dof += 1
    if dof < 1:
        msg = f"{n} draws leave fewer than 2 cells expecting 5 or more: draw more for a chi-square test"
        raise ValueError(msg)
    c = 2.0 / (9.0 * dof)
    return stat, float(dof * (1.0 - c + 3.09 * np.sqrt(c)) ** 3)


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max|got - ref| / max|ref|."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def _close(got: np.ndarray, want: np.ndarray) -> bool:
    """Within the incremental-decoding tolerance, relative to the larger of 1 and max|want|."""
    return bool(np.abs(got - want).max() <= INCREMENTAL_ABS_TOL * max(1.0, float(np.abs(want).max())))


# ------------------------------------------------------------------ distributed plans
def distributed_open(install: Path, mode: str, size: int, rank: int = 0, **options: Any) -> Any:
    """What rank ``rank`` of ``size`` makes of ``install`` with ``distributed=mode``, without a group.

    The :class:`~turbospark_core.distributed.setup.DistributedOpen` of open's
    distributed steps (every refusal, the per-rank arch, the shares, the cache
    layout, the pipeline ranges), computed in one process: how a plugin tests
    its ``distributed_plan`` against an install before launching ranks.
    """
    from turbospark_core import plugins
    from turbospark_core.distributed.group import Group
    from turbospark_core.distributed.setup import prepare
    from turbospark_core.experts.layout import ExpertLayout
    from turbospark_core.manifest import EXPERTS, WEIGHTS, load_manifest
    from turbospark_core.options import OpenOptions
    from turbospark_core.tensor_index import build_index

    class Placed(Group):
        def __init__(self) -> None:  # a rank's place; the steps computed here use no collective
            self.handle, self.size, self.rank = None, size, rank

    m = load_manifest(Path(install))
    index = build_index(m.path(WEIGHTS), m.files[WEIGHTS].size, m.quantization)
    experts = None if m.experts is None else ExpertLayout.from_section(m.experts, m.files[EXPERTS].size, "experts")
    opts = OpenOptions.from_kwargs({**options, "distributed": mode})
    return prepare(m, plugins.family_hooks(m.model_type), index, experts, opts, Placed())


# ------------------------------------------------------------------ tiny random checkpoints
def llama_tensor_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Hugging Face Llama-layout checkpoint of ``config``.

    Uses ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``vocab_size``, and
    ``head_dim`` (default ``hidden_size // num_attention_heads``); no
    ``lm_head.weight`` when ``tie_word_embeddings`` is true. Families with other
    tensors start from this dict and edit it.
    """
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, h)
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_out, h),
        "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h),
        "self_attn.o_proj.weight": (h, q_out),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def write_tiny_checkpoint(
    dst: Path, hf_config: Mapping[str, Any], tensors: Mapping[str, Sequence[int]], *, seed: int = 0
) -> Path:
    """Write a Hugging Face checkpoint directory with random float32 weights; returns ``dst``.

    ``config.json`` is ``hf_config``; ``model.safetensors`` holds one tensor per
    entry of ``tensors`` (vectors near 1, so a norm weight that is ignored
    changes the logits; matrices normal with std ``1/sqrt(fan_in)``); the
    tokenizer is word-level with one token per id (``<unk>``, ``<s>``, ``</s>``
    are ids 0-2).
    """
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    dst.mkdir(parents=True, exist_ok=True)
    weights = {name: _random_tensor(rng, tuple(shape)) for name, shape in tensors.items()}
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(dict(hf_config), indent=1))
    write_word_tokenizer(dst, int(hf_config["vocab_size"]))
    return dst


def _random_tensor(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) == 1:
        values = 1.0 + 0.1 * rng.standard_normal(shape)
    else:
        values = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return np.asarray(values, dtype=np.float32)


def write_word_tokenizer(dst: Path, vocab_size: int) -> None:
    """``tokenizer.json`` (word-level, ``w<id>`` per id) and its config files, ``</s>`` (id 2) the end of sequence."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab |= {f"w{i}": i for i in range(len(specials), vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    tok.save(str(dst / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False}
    (dst / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    (dst / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


# ------------------------------------------------------------------ the checks
class SteeringChecks:
    """Steering and residual capture through the public API (part of every harness class).

    A family whose ``steering_supported`` gives a reason must refuse a steered
    open by name; one that answers ``None`` must apply the edits exactly.
    """

    @staticmethod
    def _direction(runner: Any, seed: int = 7) -> np.ndarray:
        d = np.random.default_rng(seed).standard_normal(int(runner.manifest.arch["hidden_size"]))
        return np.asarray(d / np.linalg.norm(d), dtype=np.float32)

    @staticmethod
    def _supported(runner: Any) -> bool:
        return runner.opened.capabilities.steering_refusal is None

    def _refused_per_request(self, runner: Any, prompt_ids: list[int]) -> None:
        """A family that refuses steering refuses steered requests and capture by name too."""
        from turbospark_core.errors import FamilyRefusalError
        from turbospark_core.steering import DirectionSet

        steering = DirectionSet.from_arrays({0: self._direction(runner)}, mode="add")
        with pytest.raises(FamilyRefusalError, match="steering refused by family"):
            runner.logits(prompt_ids, steering=steering)
        with pytest.raises(FamilyRefusalError, match="steering refused by family"):
            runner.capture([prompt_ids])

    def test_steering_answer_is_recorded_and_refusal_is_by_name(
        self, runner: Any, install: Callable[..., Path]
    ) -> None:
        import turbospark_core
        from turbospark_core.errors import FamilyRefusalError
        from turbospark_core.steering import DirectionSet

        reason = runner.opened.capabilities.steering_refusal
        assert reason is None or (isinstance(reason, str) and reason)
        steering = DirectionSet.from_arrays({0: self._direction(runner)}, mode="add", scale=1.0)
        if reason is None:
            opened = turbospark_core.open(install("float32"), steering=steering)
            assert opened.steering is steering and opened.startup_stats.steering > 0.0
        else:
            with pytest.raises(FamilyRefusalError, match="steering refused by family"):
                turbospark_core.open(install("float32"), steering=steering)

    def test_steering_scale_zero_is_bit_identical(self, runner: Any, prompt_ids: list[int]) -> None:
        from turbospark_core.steering import DirectionSet

        if not self._supported(runner):
            return self._refused_per_request(runner, prompt_ids)
        n = int(runner.manifest.arch["num_hidden_layers"])
        d = self._direction(runner)
        base = runner.logits(prompt_ids)
        for mode in ("add", "ablate"):
            off = DirectionSet.from_arrays({i: d for i in range(n)}, mode=mode, scale=0.0)
            assert np.array_equal(runner.logits(prompt_ids, steering=off), base), mode

    def test_ablated_residuals_have_no_component_along_the_direction(
        self, runner: Any, prompt_ids: list[int]
    ) -> None:
        from turbospark_core.steering import DirectionSet

        if not self._supported(runner):
            return self._refused_per_request(runner, prompt_ids)
        n = int(runner.manifest.arch["num_hidden_layers"])
        d = self._direction(runner)
        plain = runner.capture([prompt_ids], position="all", steering=False)[0]
        assert plain.shape == (len(prompt_ids), n, d.size)
        along = np.abs(plain @ d) / np.linalg.norm(plain, axis=-1)
        assert along.max() > 1e-3  # the unsteered stream has a component to remove
        ablated = runner.capture(
            [prompt_ids], position="all", steering=DirectionSet.from_arrays({i: d for i in range(n)}, mode="ablate")
        )[0]
        left = np.abs(ablated.astype(np.float64) @ d) / np.linalg.norm(ablated, axis=-1)
        assert left.max() <= ABLATION_REL_TOL, f"component left: {left.max():.2e}"
        last = runner.capture([prompt_ids], layers=[n - 1], steering=False)
        assert np.array_equal(last[0, 0], plain[-1, n - 1])

    def test_each_request_gets_its_own_steering(self, runner: Any, prompt_ids: list[int]) -> None:
        from turbospark_core.steering import DirectionSet

        if not self._supported(runner):
            return self._refused_per_request(runner, prompt_ids)
        n = int(runner.manifest.arch["num_hidden_layers"])
        d = self._direction(runner)
        rms = float(np.sqrt((runner.capture([prompt_ids], layers=[n // 2], steering=False) ** 2).mean()))
        add = DirectionSet.from_arrays({n // 2: d}, mode="add", scale=8 * rms)
        base = runner.logits(prompt_ids)
        steered = runner.logits(prompt_ids, steering=add)
        assert not np.array_equal(steered, base)
        # interleaved streams: each keeps its own edit
        one = runner.stream(prompt_ids, max_tokens=4, temperature=0.0, steering=add)
        two = runner.stream(prompt_ids, max_tokens=4, temperature=0.0)
        for _ in zip(one, two, strict=False):
            pass
        for _ in one:
            pass
        for _ in two:
            pass
        assert one.result.tokens == runner.generate(prompt_ids, max_tokens=4, temperature=0.0, steering=add).tokens
        assert two.result.tokens == runner.generate(prompt_ids, max_tokens=4, temperature=0.0).tokens
        assert np.array_equal(runner.logits(prompt_ids), base)


class StructuralChecks(SteeringChecks):
    """Checks that need no reference logits: caching, independence, sessions, the hook contract.

    Subclasses provide the ``fixture_name`` values (:meth:`fixture_names`) and
    the ``install`` and ``prompt_ids`` fixtures.
    """

    compiled_decode: ClassVar[bool] = False  # the family's one-token decode step runs mx.compile'd functions

    @classmethod
    def fixture_names(cls) -> list[str]:
        """The values ``fixture_name`` takes (one run of every test each)."""
        raise NotImplementedError(f"{cls.__name__} must name its fixtures")

    @pytest.fixture
    def runner(self, install: Callable[..., Path]) -> Any:
        import turbospark_core

        return turbospark_core.open(install("float32"))

    # ------------------------------------------------------------ logits and caching
    def test_logits_have_one_finite_row_per_token(self, runner: Any, prompt_ids: list[int]) -> None:
        got = runner.logits(prompt_ids)
        assert got.shape == (len(prompt_ids), runner.manifest.arch["vocab_size"]) and got.dtype == np.float32
        assert np.isfinite(got).all()

    def test_incremental_decoding_equals_full_forward(self, runner: Any, prompt_ids: list[int]) -> None:
        ids = prompt_ids
        model, opened = runner.model, runner.opened
        full = np.array(model(mx.array([ids]))[0])
        cache = opened.new_cache()
        half = len(ids) // 2
        parts = [np.array(model(mx.array([ids[:half]]), cache)[0])]
        parts += [np.array(model(mx.array([[t]]), cache)[0]) for t in ids[half:]]
        assert _close(np.concatenate(parts), full)

    def test_fresh_context_independence(self, runner: Any, prompt_ids: list[int]) -> None:
        ids = prompt_ids
        first = runner.logits(ids)
        runner.generate(ids[::-1], max_tokens=4)
        runner.logits(ids[: len(ids) // 3])
        assert np.array_equal(first, runner.logits(ids))

    def test_batch_rows_are_independent(self, runner: Any, prompt_ids: list[int]) -> None:
        ids = prompt_ids
        other = ids[::-1]
        batch = np.array(runner.model(mx.array([ids, other]), runner.opened.new_cache()))
        assert batch.shape[:2] == (2, len(ids))
        assert np.abs(batch[0] - runner.logits(ids)).max() <= 1e-4 * np.abs(batch[0]).max()
        assert np.abs(batch[1] - runner.logits(other)).max() <= 1e-4 * np.abs(batch[1]).max()

    def test_batched_rows_equal_single_rows(self, runner: Any, prompt_ids: list[int]) -> None:
        """Continuous batching: rows of different lengths joining and leaving equal each row alone.

        Greedy tokens must match exactly; the engine's per-row positions,
        masks and cache bookkeeping are the core's, the family's forward runs
        over ``[B, 1]`` with the core's batched caches.
        """
        ids = prompt_ids
        prompts = [ids, ids[::-1][: max(2, len(ids) // 3)], ids[len(ids) // 2 :] + ids[:3]]
        limits = [6, 2, 5]  # the second row leaves early; with max_rows=2 the third joins a running batch
        got = runner.generate_many(prompts, limits, max_rows=2)
        for prompt, limit, gen in zip(prompts, limits, got, strict=False):
            assert gen.tokens == runner.generate(prompt, max_tokens=limit).tokens

    def test_session_prefix_reuse_matches_fresh_run(self, runner: Any, prompt_ids: list[int]) -> None:
        from turbospark_core.sessions import SequenceState

        ids = prompt_ids
        session = runner.session("conformance")
        session.reset()
        session.generate(ids[: len(ids) // 2], max_tokens=3)
        reused = session.generate(ids, max_tokens=6)
        assert reused.stats.reused_tokens > 0
        assert reused.tokens == runner.generate(ids, max_tokens=6).tokens
        # logits level: a parked state rewound and extended equals a fresh run of the whole prompt
        fresh = _last_logits(runner, ids, SequenceState(runner.opened.new_cache))
        parked = runner.sessions.acquire("conformance")
        kept = parked.rewind(len(ids) // 2)
        assert kept > 0
        assert _close(_last_logits(runner, ids[kept:], parked), fresh)
        session.reset()

    # ------------------------------------------------------------ fused layers
    def test_fused_layer_steps_equal_their_parts(self, install: Callable[..., Path], prompt_ids: list[int]) -> None:
        """On a q4 install, the layers a family runs as one native op (:func:`turbospark_core.family.fused_layer`)
        give the bits of its parts: the prompt's steps and one-token steps after it, for one row and for two
        rows at their own positions in the core's batched caches. Skipped where the family fuses no layer (on
        this machine, or at all)."""
        import turbospark_core
        from turbospark_core.layers import fused_steps, parts_only

        runner = turbospark_core.open(install("q4"))
        for prompts in _decode_prompts(prompt_ids):  # one row, then two rows at their own positions in a batch
            before = fused_steps()
            fused = decode_steps(runner, prompts, DECODE_STEPS)
            if fused_steps() == before:
                pytest.skip("no layer of this family runs as one fused op here (dense matrices or no native kernels)")
            after = fused_steps()
            with parts_only():
                parts = decode_steps(runner, prompts, DECODE_STEPS)
            assert fused_steps() == after  # no layer ran fused inside parts_only()
            assert np.array_equal(fused, parts), f"{len(prompts)} row(s)"

    # ------------------------------------------------------------ compiled decode
    def test_compiled_decode_equals_uncompiled(self, runner: Any, prompt_ids: list[int]) -> None:
        """One-token steps (one row; two rows at their own positions in the core's batched caches) give the
        same logits with ``mx.compile`` on as with it off, bit for bit: MLX's CPU fusion keeps the arithmetic."""
        from turbospark_core.diagnostics import compile_off

        for prompts in _decode_prompts(prompt_ids):
            compiled = decode_steps(runner, prompts, DECODE_STEPS)
            with compile_off():
                plain = decode_steps(runner, prompts, DECODE_STEPS)
            assert np.array_equal(compiled, plain), f"{len(prompts)} row(s)"

    def test_decode_steps_do_not_retrace(
        self, install: Callable[..., Path], prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A compiled function traces on its first one-token step of a batch shape, never on a later step
        (positions, cache lengths and ring wraps change every step; ``compiled_decode``: the family compiles)."""
        import turbospark_core

        traces: list[object] = []
        compile_ = mx.compile

        def counted(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            def traced(*inputs: Any) -> Any:
                traces.append(fun)  # runs only while MLX traces ``fun``
                return fun(*inputs)

            return compile_(traced, *args, **kwargs)

        monkeypatch.setattr(mx, "compile", counted)
        runner = turbospark_core.open(install("float32"))
        for prompts in _decode_prompts(prompt_ids):
            decode_steps(runner, prompts, 1)
            first = len(traces)
            decode_steps(runner, prompts, DECODE_STEPS)
            assert len(traces) == first, f"{len(prompts)} row(s): {len(traces) - first} traces after the first step"
        assert bool(traces) == (self.compiled_decode and not os.environ.get("MLX_DISABLE_COMPILE"))

    @pytest.mark.parametrize("variant", ["float32", "q4"])
    def test_a_forward_reads_nothing_from_the_install(
        self, install: Callable[..., Path], prompt_ids: list[int], variant: str
    ) -> None:
        """After the open, every weight the flow uses is in memory: a forward's graph has no lazy read of
        the install's files (one left lazy would be read again by every step, and by every call of a
        compiled step that captured it)."""
        import io

        import turbospark_core

        runner = turbospark_core.open(install(variant))
        dot = io.StringIO()
        mx.export_to_dot(dot, runner.model(mx.array([prompt_ids]), runner.opened.new_cache()))
        assert 'label ="Load"' not in dot.getvalue()

    def test_layer_count(self, runner: Any) -> None:
        assert len(runner.model.layers) == runner.manifest.arch["num_hidden_layers"]

    # ------------------------------------------------------------ hook contract
    def test_hooks_answer_the_install_arch(self, runner: Any) -> None:
        from turbospark_core import plugins

        arch = runner.manifest.arch
        hooks = plugins.family_hooks(arch["model_type"])
        assert hooks.arch_problems(arch) == []
        layout = hooks.cache_layout(arch)
        assert layout is not None and 0 < len(layout) <= arch["num_hidden_layers"]
        for kv_quant in ("q8", "q4"):
            reason = hooks.kv_quant_unsupported_reason(arch, kv_quant)
            assert reason is None or (isinstance(reason, str) and reason), f"{kv_quant}: {reason!r}"
        template = hooks.default_chat_template(arch)
        assert template is None or isinstance(template, str)

    def test_invalid_arch_is_refused_by_name(self, install: Callable[..., Path], tmp_path: Path) -> None:
        import shutil

        import turbospark_core
        from turbospark_core.errors import ArchConfigError

        bad = tmp_path / "bad"
        shutil.copytree(install("float32"), bad)
        manifest = json.loads((bad / "manifest.json").read_text())
        manifest["arch"]["num_hidden_layers"] = 0
        (bad / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ArchConfigError, match="num_hidden_layers"):
            turbospark_core.open(bad)


def _decode_prompts(ids: list[int]) -> list[list[list[int]]]:
    """One row, then two rows of different lengths (different positions in one batch)."""
    return [[ids], [ids, ids[::-1][: max(2, len(ids) // 3)]]]


def decode_steps(runner: Any, prompts: list[list[int]], steps: int) -> np.ndarray:
    """Logits ``[steps, rows, vocab]`` of greedy one-token steps after prefilling ``prompts`` (for checks).

    One prompt decodes in its own caches; several are each prefilled alone and
    then decode together in the core's batched caches (per-row positions).
    """
    from turbospark_core.batch_cache import BatchCaches

    filled = []
    for prompt in prompts:
        caches = runner.opened.new_cache()
        filled.append((caches, runner.model(mx.array([prompt]), caches)[0, -1]))
    batch = None
    if len(prompts) > 1:
        batch = BatchCaches(runner.opened.new_cache())
        for (caches, _), prompt in zip(filled, prompts, strict=True):
            batch.add_row(caches, len(prompt))
    caches = filled[0][0] if batch is None else batch.caches
    logits = mx.stack([last for _, last in filled])
    out = []
    for _ in range(steps):
        logits = runner.model(mx.argmax(logits, axis=-1)[:, None], caches)[:, -1]
        if batch is not None:
            batch.step_done(1)
        out.append(np.array(logits))
    return np.stack(out)


def _last_logits(runner: Any, ids: list[int], state: Any) -> np.ndarray:
    """Feed ``ids`` into ``state``'s caches (all but the last token, then the last); its logits."""
    if len(ids) > 1:
        runner.model(mx.array([ids[:-1]]), state.caches)
    return np.array(runner.model(mx.array([ids[-1:]]), state.caches)[0, -1])


class FamilyConformance(StructuralChecks):
    """The structural checks plus parity with reference logits, once per fixture in ``fixtures``."""

    fixtures: ClassVar[tuple[str, ...]] = ()
    float32_rel_tol: ClassVar[float] = FLOAT32_REL_TOL
    bf16_argmax_agreement: ClassVar[float] = BF16_ARGMAX_AGREEMENT

    @classmethod
    def fixture_names(cls) -> list[str]:
        return list(cls.fixtures)

    # ------------------------------------------------------------ fixtures
    @pytest.fixture
    def refs(self, turbospark_fixtures: Path, fixture_name: str) -> Any:
        return np.load(turbospark_fixtures / fixture_name / "references.npz")

    @pytest.fixture
    def prompt_ids(self, refs: Any) -> list[int]:
        return list(refs["prompt_ids"].tolist())

    @pytest.fixture
    def install(self, turbospark_install: Any, turbospark_fixtures: Path, fixture_name: str) -> Callable[..., Path]:
        """``install(variant)`` -> this fixture's install, from this class's fixtures root."""
        return lambda variant="float32": turbospark_install(fixture_name, variant, root=turbospark_fixtures)

    @pytest.fixture
    def bf16_runner(self, install: Callable[..., Path]) -> Any:
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

    @pytest.fixture
    def steering_refs(self, turbospark_fixtures: Path, fixture_name: str) -> Any:
        path = turbospark_fixtures / fixture_name / "steering.npz"
        if not path.is_file():
            pytest.skip(f"fixture {fixture_name!r} has no steering.npz (no steering references to compare)")
        return np.load(path)

    @pytest.mark.parametrize("edit", ["add", "add2", "ablate"])
    def test_steering_matches_reference(self, runner: Any, steering_refs: Any, edit: str) -> None:
        """steering.npz: addition at add_layers / add2_layers, ablation at every layer; logits and greedy."""
        from turbospark_core.steering import DirectionSet

        refs, d = steering_refs, steering_refs["direction"]
        if edit == "ablate":
            n = int(runner.manifest.arch["num_hidden_layers"])
            steering = DirectionSet.from_arrays({i: d for i in range(n)}, mode="ablate")
        else:
            layers = refs[f"{edit}_layers"].tolist()
            steering = DirectionSet.from_arrays({i: d for i in layers}, mode="add", scale=float(refs[f"{edit}_scale"]))
        prompt = refs["prompt_ids"].tolist()
        got = runner.logits(prompt, steering=steering)
        err = float(np.abs(got - refs[f"{edit}_logits"]).max())
        assert err <= STEERING_ABS_TOL, f"{edit}: max abs logit error {err:.2e}"
        want = refs[f"{edit}_greedy_tokens"].tolist()
        gen = runner.generate(prompt, max_tokens=len(want), temperature=0.0, steering=steering)
        eos = runner.eos_token_ids
        assert gen.tokens == want[: next((i for i, t in enumerate(want) if t in eos), len(want))]
        steps = runner.logits(prompt + want[:-1], steering=steering)[len(prompt) - 1 :]
        assert float(np.abs(steps - refs[f"{edit}_greedy_step_logits"]).max()) <= STEERING_ABS_TOL

    def test_bf16_weights_agree_with_reference(self, bf16_runner: Any, refs: Any) -> None:
        got = bf16_runner.logits(refs["prompt_ids"].tolist())
        ref = refs["logits_bf16_weights"]
        agreement = float((got.argmax(-1) == ref.argmax(-1)).mean())
        assert agreement >= self.bf16_argmax_agreement, f"argmax agreement {agreement:.3f}"


class TinyRandomConformance(StructuralChecks):
    """The structural checks on tiny random checkpoints: a new plugin's first tests, no reference files.

    ``tiny_configs`` maps a name to a Hugging Face ``config.json`` dict (keep it
    tiny: hidden 64, 2 layers, vocab 256). Override :meth:`tiny_tensors` when
    the checkpoint's tensors are not the Llama layout.
    """

    tiny_configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    prompt_length: ClassVar[int] = 40

    @classmethod
    def fixture_names(cls) -> list[str]:
        return list(cls.tiny_configs)

    def tiny_tensors(self, hf_config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensor names and shapes (default: :func:`llama_tensor_shapes`)."""
        return llama_tensor_shapes(hf_config)

    @pytest.fixture
    def install(self, turbospark_tiny_install: Any, fixture_name: str) -> Callable[..., Path]:
        """``install(variant="float32")`` -> the install of this config: float32 random weights, or ``"q4"``."""
        config = self.tiny_configs[fixture_name]
        tensors = self.tiny_tensors(config)
        return lambda variant="float32": turbospark_tiny_install(fixture_name, config, tensors, variant)

    @pytest.fixture
    def prompt_ids(self, fixture_name: str) -> list[int]:
        vocab = int(self.tiny_configs[fixture_name]["vocab_size"])
        ids: list[int] = np.random.default_rng(1).integers(3, vocab, size=self.prompt_length).tolist()
        return ids
