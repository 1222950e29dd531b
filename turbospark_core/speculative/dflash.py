"""The DFlash drafter: open a drafter install against its target, and draft a block per round.

:func:`open_dflash` (open step 12, ``dflash=PATH``) reads a drafter install
(made by ``turbospark convert`` from a z-lab-style checkpoint; manifest kind
``"dflash"``) with the same bounded reads as every install, checks it against
the target (hidden size, ``target_layer_ids`` among the target's layers, the
mask id in its vocabulary, a flow that exposes its layer outputs, its
embedding and LM head) and returns a :class:`DFlashFactory`, which makes one
:class:`DFlashDrafter` per sequence.

A drafter reads the target's residual after each layer of
``target_layer_ids`` (:attr:`DFlashDrafter.capture_layers`), observed after
every target forward; each round drafts ``block_size - 1`` tokens in one
forward of the drafter (:mod:`turbospark_core.speculative.dflash_model`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs
import mlx.core as mx

from turbospark_core.compute import ComputePolicy
from turbospark_core.context import Capabilities
from turbospark_core.errors import (
    ArchConfigError,
    FamilyRefusalError,
    InstallError,
    MemoryBudgetError,
    NotAnInstallError,
    OptionError,
    TurbosparkError,
)
from turbospark_core.layers import Embedding, Linear
from turbospark_core.manifest import MANIFEST, WEIGHTS, Manifest, check_files, load_manifest
from turbospark_core.speculative.dflash_config import DFLASH_KIND, DFlashConfig, arch_problems
from turbospark_core.speculative.dflash_model import ContextCache, DFlashNetwork, Project
from turbospark_core.speculative.drafter import Draft
from turbospark_core.tensor_index import TensorIndex, build_index
from turbospark_core.weights import WeightStore

if TYPE_CHECKING:
    from turbospark_core.loader import OpenedModel
    from turbospark_core.sampling import Sampler
    from turbospark_core.speculative.factory import DrafterSetup

NAME = "dflash"


class DrafterMismatchError(TurbosparkError, ValueError):
    """A drafter that does not fit the target it is opened with (hidden size, layers, vocabulary)."""


def read_drafter_install(path: Path) -> tuple[Manifest, DFlashConfig]:
    """The drafter install at ``path``: manifest (bounded read), kind, arch and files checked.

    Raises:
        NotAnInstallError: A checkpoint (convert it first), or an install of another kind.
        InstallError: A missing path, a bad manifest or file table.
        ArchConfigError: An arch that fails the drafter's bounded checks.
    """
    if not path.is_dir():
        msg = f"dflash={str(path)!r} is not a directory; pass a DFlash drafter install made by `turbospark convert`"
        raise InstallError(msg)
    if not (path / MANIFEST).exists() and (path / "config.json").exists():
        msg = (
            f"dflash={str(path)!r} is a checkpoint, not a turbospark install; make one with "
            f"`turbospark convert {path} DST` and pass dflash=DST"
        )
        raise NotAnInstallError(msg)
    manifest = load_manifest(path)
    if manifest.kind != DFLASH_KIND:
        msg = (
            f"dflash={str(path)!r} is a {manifest.kind!r} install (model type {manifest.model_type!r}), not a "
            f"DFlash drafter install; pass the install `turbospark convert` made from a DFlashDraftModel checkpoint"
        )
        raise NotAnInstallError(msg)
    problems = arch_problems(manifest.arch)
    if problems:
        msg = f"{path / MANIFEST}: the DFlash drafter's arch config is invalid: " + "; ".join(problems)
        raise ArchConfigError(msg)
    check_files(manifest)
    return manifest, DFlashConfig.from_arch(manifest.arch)


def check_against_target(cfg: DFlashConfig, target: Mapping[str, Any], path: Path) -> None:
    """The drafter fits the target: equal hidden size, layers that exist, a mask id in the vocabulary.

    Raises:
        DrafterMismatchError: Naming the first mismatch.
    """
    hidden, layers, vocab = int(target["hidden_size"]), int(target["num_hidden_layers"]), int(target["vocab_size"])
    where = f"DFlash drafter {str(path)!r}"
    if cfg.hidden_size != hidden:
        msg = (
            f"{where} has hidden_size {cfg.hidden_size}, the target (model type {target.get('model_type')!r}) "
            f"{hidden}; pass the drafter trained for this target"
        )
        raise DrafterMismatchError(msg)
    bad = [i for i in cfg.target_layer_ids if i >= layers]
    if bad:
        msg = (
            f"{where} reads target layer {bad[0]} (target_layer_ids {list(cfg.target_layer_ids)}), but the target "
            f"has layers 0..{layers - 1}; pass the drafter trained for this target"
        )
        raise DrafterMismatchError(msg)
    if cfg.mask_token_id >= vocab:
        msg = (
            f"{where} has mask_token_id {cfg.mask_token_id}, outside the target's vocabulary [0, {vocab}); "
            "pass the drafter trained for this target"
        )
        raise DrafterMismatchError(msg)


def target_projections(model: object, family: str) -> tuple[Project, Project, int]:
    """The target's token embedding and LM head (a tied head is the embedding's ``as_linear``), and the
    head's weight bytes.

    Raises:
        FamilyRefusalError: The family's model exposes no ``embed_tokens`` embedding (or an
            ``lm_head`` that is not a linear), so a drafter cannot borrow them.
    """
    embed = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if not isinstance(embed, Embedding) or not (head is None or isinstance(head, Linear)):
        msg = (
            f"dflash refused by family {family!r}: its model exposes no `embed_tokens` Embedding and `lm_head` "
            "Linear (or None when tied), which a DFlash drafter uses as its own; open without dflash"
        )
        raise FamilyRefusalError(msg)
    matrix = embed.table if head is None else head
    return embed, (embed.as_linear if head is None else head), int(matrix.weight.nbytes)


def _check_tensors(manifest: Manifest, cfg: DFlashConfig) -> TensorIndex:
    index = build_index(manifest.path(WEIGHTS), manifest.files[WEIGHTS].size, manifest.quantization)
    want = cfg.tensor_shapes()
    bases = {name.rpartition(".")[0] for name in index.tensors if name.rpartition(".")[0] in index.quantization}
    have = {f"{b}.weight" for b in bases} | {n for n in index.tensors if n.rpartition(".")[0] not in bases}
    extra, missing = sorted(have - set(want)), sorted(set(want) - have)
    if extra or missing:
        what = f"has tensor {extra[0]!r}, which" if extra else f"lacks tensor {missing[0]!r}, which"
        msg = (
            f"{manifest.root}: the DFlash drafter install {what} its arch config does "
            f"{'not name' if extra else 'need'}; re-run `turbospark convert`"
        )
        raise InstallError(msg)
    for name, shape in want.items():
        base = name.rpartition(".")[0]
        got = index.logical_shape(base) if base in index.quantization else index.tensors[name].shape
        if tuple(got) != shape:
            msg = (
                f"{manifest.root}: DFlash drafter tensor {name!r} has shape {list(got)}, its arch config "
                f"needs {list(shape)}; re-run `turbospark convert`"
            )
            raise InstallError(msg)
    return index


def _check_memory(
    index: TensorIndex,
    cfg: DFlashConfig,
    policy: ComputePolicy,
    max_context: int,
    memory_left: int | None,
    root: Path,
    slots: int = 1,
) -> int:
    """The drafter's weights (as the policy holds them) and ``slots`` sequences' context K/V at ``max_context``
    must fit ``memory_left``; returns those bytes."""
    itemsize = mx.float32.size if policy.unpack else policy.compute_dtype.size
    weights = index.float_bytes(itemsize) if policy.unpack else index.stored_bytes()
    kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * policy.compute_dtype.size * max_context * slots
    if memory_left is not None and weights + kv > memory_left:
        msg = (
            f"the DFlash drafter {str(root)!r} needs ~{(weights + kv) / 1e9:.2f} GB (weights {weights / 1e9:.2f} GB, "
            f"context K/V at max_context={max_context} x {slots} slot(s) {kv / 1e9:.2f} GB) but only "
            f"{max(memory_left, 0) / 1e9:.2f} GB of memory_budget is left after the model; lower max_context or "
            "session_slots, raise memory_budget or open without dflash"
        )
        raise MemoryBudgetError(msg)
    return weights + kv


def open_dflash(
    path: str | Path,
    *,
    target_arch: Mapping[str, Any],
    target_model: object,
    capabilities: Capabilities,
    policy: ComputePolicy,
    max_context: int,
    memory_left: int | None = None,
    slots: int = 1,
) -> DFlashFactory:
    """Open step 12 for ``dflash=PATH``: read and check the drafter install, bind it to the target.

    Raises:
        InstallError / NotAnInstallError / ArchConfigError: The drafter install is bad.
        DrafterMismatchError: It does not fit the target.
        FamilyRefusalError: The target's flow cannot hand over its layer outputs or its embedding and head.
        MemoryBudgetError: Its weights and context cache at ``max_context`` exceed ``memory_left`` bytes.
    """
    root = Path(path)
    manifest, cfg = read_drafter_install(root)
    check_against_target(cfg, target_arch, root)
    if capabilities.steering_refusal is not None:
        msg = (
            f"dflash refused by family {capabilities.family!r}: a DFlash drafter reads the target's layer "
            f"outputs, which this flow does not expose ({capabilities.steering_refusal})"
        )
        raise FamilyRefusalError(msg)
    embed, head, head_bytes = target_projections(target_model, capabilities.family)
    index = _check_tensors(manifest, cfg)
    memory = _check_memory(index, cfg, policy, max_context, memory_left, root, slots)
    weights = WeightStore(manifest.path(WEIGHTS), index, policy)
    network = DFlashNetwork(cfg, weights, embed, head, policy.compute_dtype)
    weights.materialize()
    return DFlashFactory(
        network=network,
        max_context=max_context,
        root=root,
        round_bytes=index.stored_bytes() + head_bytes,
        memory=memory,
    )


def dflash_factory(setup: DrafterSetup | None) -> DFlashFactory:
    """The DFlash drafter of an open, or an ``OptionError`` saying how to open one."""
    factory = None if setup is None else setup.new
    if not isinstance(factory, DFlashFactory):
        has = "no drafter" if setup is None else f"the {setup.name!r} drafter"
        raise OptionError(f"this Runner has {has}, not a DFlash drafter; open the model with dflash=PATH")
    return factory


def default_draft_length(path: Path) -> int:
    """``num_draft_tokens`` when not given: every mask slot of the drafter's block, ``block_size - 1``."""
    _, cfg = read_drafter_install(Path(path))
    return cfg.block_size - 1


def setup_dflash(opened: OpenedModel, path: Path, k: int) -> DrafterSetup:
    """Open step 12 for ``dflash=PATH`` on the opened target: the :class:`DrafterSetup` the runner decodes with."""
    from turbospark_core.speculative.factory import DrafterSetup

    factory = open_dflash(
        path,
        target_arch=opened.manifest.arch,
        target_model=opened.model,
        capabilities=opened.capabilities,
        policy=opened.policy,
        max_context=opened.max_context,
        memory_left=opened.options.memory_budget - opened.estimate.total,
        slots=opened.options.session_slots,
    )
    # One round reads the drafter's weights and the target's LM head once, whatever k: per drafted token,
    # in plain target decode steps (each reads the target's weights once)
    head = factory.round_bytes / max(opened.estimate.weights, 1)
    cfg = factory.network.cfg
    return DrafterSetup(
        name=NAME,
        new=factory,
        num_draft_tokens=k,
        draft_cost=head / max(k, 1),
        adaptive=opened.options.num_draft_tokens is None,
        description=(
            f"dflash {factory.root} (block {cfg.block_size}, reads layers {list(cfg.target_layer_ids)}, "
            f"up to {k} tokens per verify)"
        ),
        memory=factory.memory,
    )


@attrs.frozen(kw_only=True)
class DFlashFactory:
    """Makes a fresh :class:`DFlashDrafter` per sequence; holds the opened drafter network."""

    network: DFlashNetwork = attrs.field(eq=False, repr=False)
    max_context: int
    root: Path
    round_bytes: int = 0  # weight bytes one round reads: the drafter's and the target's LM head
    memory: int = 0  # what the drafter adds to the open's estimate: weights, context K/V for every session slot

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose outputs the drafter reads."""
        return self.network.cfg.target_layer_ids

    @property
    def block_size(self) -> int:
        """Tokens per block: the anchor and ``block_size - 1`` drafts."""
        return self.network.cfg.block_size

    def __call__(self) -> DFlashDrafter:
        return DFlashDrafter(self.network, self.max_context)

    def block_logits(self, hidden: Mapping[int, mx.array], anchor: int) -> mx.array:
        """One round on a fresh sequence: context ``hidden[l]`` ``[T, H]`` at 0..T-1, anchor at ``T``.

        Returns the float32 logits ``[block_size - 1, vocab]`` of slots ``1 .. B-1``.
        """
        drafter = self()
        drafter.observe(0, hidden)
        length = int(hidden[self.capture_layers[0]].shape[0])
        return drafter.round_logits(anchor, length)


@attrs.define
class _Segment:
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


class DFlashDrafter:
    """One sequence's DFlash drafter (the :class:`~turbospark_core.speculative.drafter.Drafter` protocol).

    Its context cache holds ``c_t`` of committed positions (RoPE'd keys and
    values per drafter layer), in position order, possibly with gaps (positions
    a reused session prefix never showed it). Observed states wait until a
    round needs them, so a verify's rejected rows are dropped before any work.
    """

    name = NAME

    def __init__(self, network: DFlashNetwork, max_context: int) -> None:
        self._net = network
        self._max_context = max_context
        self.capture_layers: tuple[int, ...] = network.cfg.target_layer_ids
        self._caches: list[ContextCache] = network.new_context(max_context)
        self._segments: list[_Segment] = []  # positions held in the cache, in order
        self._pending: list[tuple[int, dict[int, mx.array]]] = []

    @property
    def context_length(self) -> int:
        """Context entries the cache holds."""
        return sum(s.length for s in self._segments)

    def reset(self) -> None:
        """Forget the sequence."""
        self._caches = self._net.new_context(self._max_context)
        self._segments.clear()
        self._pending.clear()

    def observe(self, start: int, hidden: Mapping[int, mx.array]) -> None:
        """Keep the target's layer outputs of positions ``start ..`` until a round reads them."""
        self._pending.append((start, {layer: hidden[layer] for layer in self.capture_layers}))

    def rewind(self, length: int) -> None:
        """Committed context is ``length`` tokens: states of positions ``>= length - 1`` are dropped."""
        valid = max(0, length - 1)
        self._pending = [
            (start, {layer: h[: valid - start] for layer, h in rows.items()})
            for start, rows in self._pending
            if start < valid
        ]
        kept: list[_Segment] = []
        for seg in self._segments:
            if seg.start < valid:
                kept.append(_Segment(seg.start, min(seg.end, valid) - seg.start))
        if kept != self._segments:
            held = sum(s.length for s in kept)
            for cache in self._caches:
                cache.keep(held)
            self._segments = kept

    def _flush(self, position: int) -> None:
        """Move observed states of positions ``< position`` (past those held) into the context cache."""
        pending, self._pending = self._pending, []
        for start, rows in pending:
            n = int(next(iter(rows.values())).shape[0])
            begin = max(start, self._segments[-1].end if self._segments else 0)
            end = min(start + n, position)
            if end <= begin:
                continue
            features = [rows[layer][begin - start : end - start] for layer in self.capture_layers]
            self._net.append_context(self._caches, features, begin)
            last = self._segments[-1] if self._segments else None
            if last is not None and last.end == begin:
                last.length += end - begin
            else:
                self._segments.append(_Segment(begin, end - begin))

    def round_logits(self, anchor: int, position: int) -> mx.array:
        """The block anchored at ``anchor`` (position ``position``): logits ``[B-1, vocab]`` float32."""
        self._flush(position)
        return self._net.block_logits(anchor, position, self._caches)

    def propose(self, context: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """Up to ``min(k, block_size - 1)`` drafts after ``context`` from one drafter forward."""
        if not context:
            raise OptionError("a DFlash round needs at least one committed token (the anchor)")
        n = min(k, self._net.cfg.block_size - 1)
        if n <= 0:
            return Draft(tokens=())
        logits = self.round_logits(int(context[-1]), len(context) - 1)[:n]
        if sampler.params.greedy:
            return Draft(tokens=mx.argmax(logits, axis=-1).tolist())  # type: ignore[arg-type]  # ints
        return _sample(logits, context, sampler)


def _sample(logits: mx.array, context: Sequence[int], sampler: Sampler) -> Draft:
    """Draw each slot's token from its sampling distribution ``q`` (penalty over context + earlier drafts)."""
    if sampler.params.repetition_penalty == 1.0:  # no history: every slot at once
        logq = sampler.logprobs(logits)
        drawn = mx.random.categorical(logq, axis=-1, key=sampler.next_key())
        return Draft(tokens=drawn.tolist(), probs=mx.exp(logq))  # type: ignore[arg-type]  # ints
    window = sampler.params.repetition_context
    history = list(context[-window:])
    tokens: list[int] = []
    probs = []
    for i in range(logits.shape[0]):
        row = sampler.penalize(logits[i : i + 1], mx.array(history[-window:]))
        logq = sampler.logprobs(row)
        token = cast(int, mx.random.categorical(logq, axis=-1, key=sampler.next_key())[0].item())
        tokens.append(token)
        probs.append(mx.exp(logq)[0])
        history.append(token)
    return Draft(tokens=tokens, probs=mx.stack(probs))
