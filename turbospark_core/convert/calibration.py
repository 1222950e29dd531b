"""``convert --calibrate``: GPTQ for every linear the family calls, from the model's own inputs on a text.

The float model (after any ``--rotate``, before quantizing) is written to a
temporary install inside the staging directory and opened by turbospark's own
runtime with a weight store that hands out recording wrappers
(:class:`CalibrationStore`): each linear the family calls accumulates
``X^T X`` of its inputs, whatever the family's code. The wrappers are not
:class:`~turbospark_core.layers.Linear`, so the family leaves them unfused
(each matrix is seen on its own). The text is cut into sequences of
:data:`SEGMENT` tokens, each run as a fresh sequence.

Inputs are **full-precision** by default: every matrix's ``X^T X`` comes from
the float model, so one pass over the text serves all of them (the pass
ends, by an exception out of the family's flow, once the last recorded matrix
has been called: an LM head left to rounding is never computed). With
``sequential`` (``--calibrate-sequential``) they are sequential by decoder
layer, as in the GPTQ and QuaRot reference implementations: layer ``i``'s
matrices are solved from inputs computed with layers ``0..i-1`` already
quantized, so each layer compensates the error of those before it. The core
cannot start a forward at layer ``i``, so that costs one pass per layer, each
stopping after its layer: about ``L / 2`` forwards over the text instead of
one. Matrices with no ``layers.N.`` in their name (an untied LM head) come
last. Memory: ``X^T X`` (float32, ``cols x cols``) is held only for the
matrices being solved; full-precision passes take as many layers at a time as
:data:`HESSIAN_BYTES` allows.

Left to round-to-nearest: expert stacks (GPTQ per routed expert would need
each expert's own inputs), a matrix the family also gathers rows of (an
embedding, including one tied to the head: its lookups are not inputs times
the matrix), one the calibration never reached, and the multi-token-prediction
head.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core import plugins
from turbospark_core.compute import ComputePolicy
from turbospark_core.convert.assemble import MIN_CALIBRATION_TOKENS, QUANTIZE, ConvertOptions
from turbospark_core.convert.gptq import DAMP, Solved, gptq
from turbospark_core.convert.records import AffineQuantized
from turbospark_core.convert.writer import write_install
from turbospark_core.diagnostics import compile_off
from turbospark_core.errors import ConversionError, TurbosparkError
from turbospark_core.layers import Embedding, Linear
from turbospark_core.manifest import MTP_PREFIX
from turbospark_core.progress import progress
from turbospark_core.tensor_index import TensorIndex
from turbospark_core.tokenizer import Tokenizer
from turbospark_core.weights import WeightStore

MIN_TOKENS = MIN_CALIBRATION_TOKENS  # below this a calibration text is refused
DEFAULT_TOKENS = 16384  # tokens of the text used unless --calibrate-tokens says otherwise
SEGMENT = 512  # tokens per sequence; at most the model's context
HESSIAN_BYTES = 2 << 30  # X^T X held at once (full-precision passes group layers up to it)
CALIBRATION_DIR = "calibration"  # the temporary float install, inside the staging directory
BUILTIN = Path(__file__).with_name("calibration.txt")  # bundled English (``--calibrate`` without a file)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_LAST = 1 << 62  # the stage of matrices outside every numbered layer


def read_text(path: str | Path) -> str:
    """The calibration text (UTF-8).

    Raises:
        ConversionError: A missing, unreadable, non-UTF-8 or blank file, naming it.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        msg = f"--calibrate: no file {path}; pass a UTF-8 text file (or --calibrate alone for the bundled text)"
        raise ConversionError(msg) from None
    except (OSError, UnicodeDecodeError) as e:
        msg = f"--calibrate: cannot read {path} as UTF-8 text ({e}); pass a UTF-8 text file"
        raise ConversionError(msg) from None
    if not text.strip():
        msg = f"--calibrate: {path} is empty; pass a text of at least {MIN_TOKENS} tokens"
        raise ConversionError(msg)
    return text


def stage_of(base: str) -> int:
    """The calibration stage of matrix ``base``: its decoder layer, or after every layer."""
    m = _LAYER.search(base)
    return _LAST if m is None else int(m.group(1))


class _StageDone(Exception):  # noqa: N818 - a signal, not an error
    """Raised out of the family's flow once the matrices being recorded have all been called."""


@attrs.define(eq=False)
class Recorder:
    """``X^T X`` per matrix being recorded, and which matrices the family called.

    Attributes:
        linears: Every wrapped matrix by base name.
        gathered: Bases the family also takes rows of (embeddings).
        called: Bases called since the recorder was made.
        sums: ``X^T X`` (float32, evaluated) per matrix being recorded.
    """

    linears: dict[str, CalibratedLinear] = attrs.Factory(dict)
    gathered: set[str] = attrs.Factory(set)
    called: set[str] = attrs.Factory(set)
    sums: dict[str, mx.array] = attrs.Factory(dict)
    _members: frozenset[str] = frozenset()
    _last_stage: int = _LAST
    _seen: set[str] = attrs.Factory(set)
    _last: tuple[mx.array, mx.array] | None = None  # the latest input and its X^T X (q/k/v share one)

    def start(self, members: frozenset[str]) -> None:
        """Record ``members`` from now on (forgetting earlier sums). A forward ends (:class:`_StageDone`)
        when, every member called, a wrapped matrix of a later stage than all of them is called."""
        self._members = members
        self._last_stage = max((stage_of(b) for b in members), default=_LAST)
        self.sums.clear()

    def begin_forward(self) -> None:
        """A new sequence starts."""
        self._seen.clear()
        self._last = None

    def observe(self, base: str, x: mx.array) -> None:
        """One call of ``base`` with input ``x``."""
        self.called.add(base)
        if base not in self._members:
            if self._members and stage_of(base) > self._last_stage and self._seen >= self._members:
                raise _StageDone
            return
        if self._last is None or self._last[0] is not x:
            flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
            self._last = (x, flat.T @ flat)
        xtx = self._last[1]
        self.sums[base] = xtx if base not in self.sums else self.sums[base] + xtx
        mx.eval(self.sums[base])
        self._seen.add(base)


class CalibratedLinear:
    """A linear that reports its input to the :class:`Recorder`, then multiplies as the plain one."""

    def __init__(self, base: str, inner: Linear, recorder: Recorder) -> None:
        self.base, self.inner, self.recorder = base, inner, recorder

    def __call__(self, x: mx.array) -> mx.array:
        self.recorder.observe(self.base, x)
        return self.inner(x)

    def __getattr__(self, name: str) -> Any:  # weight, bias, quant, scales, out_features...
        return getattr(self.inner, name)


class CalibrationStore(WeightStore):
    """The weight store of the calibration open: the ``targets`` matrices come wrapped."""

    def __init__(
        self, path: Path, index: TensorIndex, policy: ComputePolicy, *, recorder: Recorder, targets: frozenset[str]
    ) -> None:
        super().__init__(path, index, policy)
        self.recorder, self.targets = recorder, targets

    def linear(self, base: str, *, native_ok: bool = True) -> Linear:
        """As :meth:`WeightStore.linear`; a target matrix is wrapped in a :class:`CalibratedLinear`."""
        lin = super().linear(base, native_ok=native_ok)
        if base not in self.targets:
            return lin
        wrapped = CalibratedLinear(base, lin, self.recorder)
        self.recorder.linears[base] = wrapped
        return wrapped  # type: ignore[return-value]  # a Linear in all but type (as diagnostics' ObservedLinear)

    def embedding(self, base: str) -> Embedding:
        """As :meth:`WeightStore.embedding`; the matrix is marked as gathered (left to round-to-nearest)."""
        self.recorder.gathered.add(base)
        return super().embedding(base)


@attrs.frozen(kw_only=True)
class Calibration:
    """What ``--calibrate`` solved: packed matrices by base name, and the provenance record."""

    solved: dict[str, AffineQuantized]
    record: dict[str, Any]


@attrs.frozen(kw_only=True)
class _FloatModel:
    """The opened float model: its flow, cache maker, tokenizer and tokens per sequence."""

    model: Any
    new_cache: Callable[[], list[Any]]
    tokenizer: Tokenizer
    segment: int

    def run(self, segments: list[list[int]], recorder: Recorder) -> None:
        """Each segment through the flow, as a fresh sequence (uncompiled: a trace would not record)."""
        with compile_off():
            for seg in segments:
                recorder.begin_forward()
                with contextlib.suppress(_StageDone):
                    self.model(mx.array([seg]), self.new_cache())


def calibrate(
    work: Path,
    tensors: Mapping[str, mx.array],
    quantization: Mapping[str, Any],
    targets: Sequence[str],
    *,
    text: str,
    options: ConvertOptions,
    arch: dict[str, Any],
    texts: dict[str, str],
    hooks: plugins.FamilyHooks,
    hadamard: tuple[dict[str, Any], bytes] | None,
    show_progress: bool = False,
) -> Calibration:
    """GPTQ for the ``targets`` matrices (bases of float ``[out, in]`` weights in ``tensors``), from the
    model's inputs on ``text`` (the ``options.calibrate`` file's, at most ``options.calibrate_tokens`` tokens;
    sequential by layer with ``options.calibrate_sequential``).

    ``work``: a directory for the temporary float install (made and removed here).

    Raises:
        ConversionError: A text of too few tokens, a float model the runtime cannot
            open, or a flow that calls none of the targets.
    """
    assert options.quantize is not None  # ConvertOptions refuses --calibrate without --quantize
    bits, group_size, sequential = QUANTIZE[options.quantize], options.group_size, options.calibrate_sequential
    if not targets:
        msg = (
            f"--calibrate: the source has no float matrix for --quantize {options.quantize} --group-size "
            f"{group_size} to quantize (all are quantized already, or narrower than a group); convert without "
            f"--calibrate"
        )
        raise ConversionError(msg)
    recorder = Recorder()
    try:
        fm = _open_float(work, tensors, quantization, frozenset(targets), recorder, arch, texts, hooks, hadamard)
        ids = fm.tokenizer.encode(text)
        if len(ids) < MIN_TOKENS:
            msg = (
                f"--calibrate: {options.calibrate} is {len(ids)} tokens; calibration needs at least {MIN_TOKENS}, "
                f"pass a longer text"
            )
            raise ConversionError(msg)
        ids = ids[: options.calibrate_tokens or DEFAULT_TOKENS]
        segments = [ids[i : i + fm.segment] for i in range(0, len(ids), fm.segment)]
        fm.run(segments[:1], recorder)  # which matrices the flow calls (nothing recorded)
        solvable = sorted(recorder.called - recorder.gathered)
        if not solvable:
            msg = (
                f"--calibrate: family {hooks.spec.name!r} (model type {arch['model_type']!r}) calls none of the "
                f"{len(targets)} matrices --quantize quantizes through the core's Linear; convert without --calibrate"
            )
            raise ConversionError(msg)
        solved: dict[str, AffineQuantized] = {}
        damping: dict[str, float] = {}
        passes = _passes(solvable, tensors, sequential)
        for members in progress(passes, len(passes), "calibrating", enabled=show_progress):
            recorder.start(members)
            fm.run(segments, recorder)
            for base in sorted(members):
                result = _solve(base, tensors[f"{base}.weight"], recorder.sums.pop(base), bits, group_size)
                solved[base] = result.quantized
                if result.damp != DAMP:
                    damping[base] = result.damp
                if sequential:  # the next passes read this matrix quantized (a new Linear: it caches W^T)
                    wrapped = recorder.linears[base]
                    dtype = wrapped.inner.weight.dtype
                    wrapped.inner = Linear(mx.array(result.dequantized).astype(dtype), wrapped.inner.bias)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {
        "method": "gptq",
        "inputs": "sequential" if sequential else "full-precision",
        "text": options.calibrate,
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "tokens": len(ids),
        "segment": fm.segment,
        "damp": DAMP,
        "gptq": len(solved),
        "round_to_nearest": sorted(set(targets) - set(solved)),
        "damping_raised": damping,
    }
    return Calibration(solved=solved, record=record)


def _passes(solvable: list[str], tensors: Mapping[str, mx.array], sequential: bool) -> list[frozenset[str]]:
    """The matrices recorded by each pass over the text: one decoder layer each (sequential), else
    consecutive layers while their ``X^T X`` fit :data:`HESSIAN_BYTES` (at least one layer a pass)."""
    stages: dict[int, list[str]] = {}
    for base in solvable:
        stages.setdefault(stage_of(base), []).append(base)
    out: list[frozenset[str]] = []
    group: list[str] = []
    held = 0
    for stage in sorted(stages):
        need = sum(4 * tensors[f"{b}.weight"].shape[-1] ** 2 for b in stages[stage])
        if group and (sequential or held + need > HESSIAN_BYTES):
            out.append(frozenset(group))
            group, held = [], 0
        group += stages[stage]
        held += need
    out.append(frozenset(group))
    return out


def _solve(base: str, weight: mx.array, xtx: mx.array, bits: int, group_size: int) -> Solved:
    return gptq(
        np.array(weight.astype(mx.float32)),
        np.array(xtx),
        bits=bits,
        group_size=group_size,
        scale_dtype=weight.dtype,
        name=base,
    )


def _open_float(
    work: Path,
    tensors: Mapping[str, mx.array],
    quantization: Mapping[str, Any],
    targets: frozenset[str],
    recorder: Recorder,
    arch: dict[str, Any],
    texts: dict[str, str],
    hooks: plugins.FamilyHooks,
    hadamard: tuple[dict[str, Any], bytes] | None,
) -> _FloatModel:
    """Write the float model (without a multi-token-prediction head) to ``work`` and open it recording."""
    from turbospark_core.loader import open_install
    from turbospark_core.options import OpenOptions

    work.mkdir(parents=True)
    write_install(
        work,
        arch=arch,
        tensors={n: a for n, a in tensors.items() if not n.startswith(MTP_PREFIX)},
        quantization={b: q for b, q in quantization.items() if not b.startswith(MTP_PREFIX)},
        text_files=texts,
        family=hooks.spec.name,
        distribution=hooks.spec.distribution,
        provenance={"calibration": True},
        hadamard=hadamard,
    )

    def store(path: Path, index: TensorIndex, policy: ComputePolicy) -> WeightStore:
        return CalibrationStore(path, index, policy, recorder=recorder, targets=targets)

    limit = arch.get("max_position_embeddings")
    segment = min(SEGMENT, limit) if isinstance(limit, int) and limit > 0 else SEGMENT
    try:
        opened = open_install(work, OpenOptions(max_context=segment), store=store)
    except TurbosparkError as e:
        msg = f"--calibrate: the float model does not open for calibration ({e}); convert without --calibrate"
        raise ConversionError(msg) from None
    tokenizer = Tokenizer.from_install(work, opened.generation_config, lambda: hooks.default_chat_template(arch))
    return _FloatModel(model=opened.model, new_cache=opened.new_cache, tokenizer=tokenizer, segment=segment)
