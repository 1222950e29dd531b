"""Open step 12: the drafter an open asks for, its refusals, and where each drafter kind plugs in.

Each drafter option of :class:`~turbospark_core.options.OpenOptions` (listed
in ``DRAFTER_OPTIONS``) has a *builder* in :data:`BUILDERS`: given the opened
target and the option's value, it returns a :class:`DrafterSetup` (or
``None``: decode plainly, e.g. ``mtp="auto"`` on an install without a head)
or raises :class:`~turbospark_core.errors.DrafterError` naming what is
missing. :data:`DEFAULT_LENGTH` gives each kind's default
``num_draft_tokens``. A new drafter kind adds its option name to
``DRAFTER_OPTIONS``, a field to ``OpenOptions`` (and ``open``), and an entry
to both dicts here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from turbospark_core.errors import DrafterError, InstallError, MemoryBudgetError
from turbospark_core.speculative.adaptive import DraftHistory
from turbospark_core.speculative.drafter import DrafterFactory

if TYPE_CHECKING:
    from turbospark_core.loader import OpenedModel
    from turbospark_core.manifest import Manifest
    from turbospark_core.options import OpenOptions

DEFAULT_DRAFT_MODEL_TOKENS = 4


@attrs.frozen(kw_only=True)
class DrafterSetup:
    """The drafter open step 12 chose (``OpenedModel.drafter``).

    Attributes:
        name: The drafter kind (the option that chose it).
        new: Makes a fresh per-sequence :class:`~.drafter.Drafter`.
        num_draft_tokens: The most tokens drafted per verify.
        draft_cost: One drafted token's cost in plain target decode steps (0
            for prompt lookup; the weight-size ratio for a draft model); the
            adaptive draft length weighs it.
        adaptive: Adapt the draft length to the measured acceptance (the
            default); an explicit ``num_draft_tokens`` drafts that many every step.
        description: What ``turbospark inspect`` prints.
        draft: A draft model's own opened install (``None`` for other kinds).
        history: What the sequences drafted for so far taught the adaptive
            draft length (step times, acceptance), shared by all of them.
        memory: Bytes the drafter adds to the open's memory estimate (its
            weights and its per-sequence state at ``max_context`` for every
            session slot), checked against ``memory_budget`` with the target's.
    """

    name: str
    new: DrafterFactory = attrs.field(eq=False, repr=False)
    num_draft_tokens: int
    draft_cost: float = 0.0
    adaptive: bool = True
    description: str = ""
    draft: OpenedModel | None = attrs.field(default=None, eq=False, repr=False)
    history: DraftHistory = attrs.field(factory=DraftHistory, eq=False, repr=False)
    memory: int = 0


Builder = Callable[["OpenedModel", Any], "DrafterSetup | None"]


def draft_length(options: OpenOptions) -> int:
    """The most tokens drafted per verify under ``options`` (0: no drafter named)."""
    named = options.drafters_named()
    if not named:
        return 0
    if options.num_draft_tokens is not None:
        return int(options.num_draft_tokens)
    return DEFAULT_LENGTH[named[0]](getattr(options, named[0]))


def check_budget(opened: OpenedModel, option: str, extra: int, detail: str) -> None:
    """The open's estimate plus a drafter's ``extra`` bytes must fit ``memory_budget``.

    Raises:
        MemoryBudgetError: Naming the drafter's share (``detail``: its breakdown) and the knobs.
    """
    estimate, budget = opened.estimate, opened.options.memory_budget
    if estimate.total + extra <= budget:
        return
    msg = (
        f"{option} needs ~{extra / 1e9:.3f} GB ({detail}) on top of the ~{estimate.total / 1e9:.2f} GB "
        f"the model needs, but memory_budget is {budget / 1e9:.2f} GB; open without {option}, "
        f"lower max_context or session_slots, or raise memory_budget"
    )
    raise MemoryBudgetError(msg)


def refuse_hadamard(manifest: Manifest, options: OpenOptions, role: str = "") -> None:
    """An install with a ``hadamard`` section refuses every drafter (a drafter's inputs would need the transforms)."""
    named = options.drafters_named()
    if named and manifest.hadamard is not None:
        msg = (
            f"{role}{manifest.root} is hadamard-folded and cannot serve a speculative drafter "
            f"({named[0]}={getattr(options, named[0])!r}): the drafter's inputs would need the same "
            f"rotation; drop {named[0]} or re-convert without hadamard folding"
        )
        raise DrafterError(msg)


def make_drafter(opened: OpenedModel) -> DrafterSetup | None:
    """Open step 12: build the drafter ``opened.options`` names (``None``: decode plainly)."""
    options = opened.options
    named = options.drafters_named()
    if not named:
        return None
    refuse_hadamard(opened.manifest, options)
    return BUILDERS[named[0]](opened, getattr(options, named[0]))


# ------------------------------------------------------------------ ngram
def _build_ngram(opened: OpenedModel, n: int) -> DrafterSetup:
    from turbospark_core.speculative.ngram import NgramDrafter

    k = draft_length(opened.options)
    return DrafterSetup(
        name="ngram",
        new=NgramDrafter,
        num_draft_tokens=k,
        adaptive=opened.options.num_draft_tokens is None,
        description=f"ngram (prompt lookup, up to {k} tokens per verify)",
    )


# ------------------------------------------------------------------ draft model
def _vocab(root: Path) -> dict[str, int]:
    from tokenizers import Tokenizer as HFTokenizer

    vocab: dict[str, int] = HFTokenizer.from_file(str(root / "tokenizer.json")).get_vocab(with_added_tokens=True)
    return vocab


def refuse_vocab_mismatch(target: Manifest, draft: Manifest) -> None:
    """A draft install must share the target's vocabulary: same size and same token -> id map."""
    tv, dv = int(target.arch["vocab_size"]), int(draft.arch["vocab_size"])
    if tv != dv:
        msg = (
            f"draft_model {draft.root} has vocab_size {dv} but {target.root} has {tv}; "
            f"a draft model must share the target's vocabulary (use a model with the same tokenizer)"
        )
        raise DrafterError(msg)
    t_vocab, d_vocab = _vocab(target.root), _vocab(draft.root)
    if t_vocab != d_vocab:
        by_id = {i: s for s, i in d_vocab.items()}
        diff = sorted((i, s) for s, i in t_vocab.items() if by_id.get(i) != s)
        i, s = diff[0] if diff else (len(t_vocab), "?")
        msg = (
            f"draft_model {draft.root} has a different tokenizer vocabulary than {target.root} "
            f"(token id {i} is {s!r} in the target, {by_id.get(i)!r} in the draft); "
            f"a draft model must share the target's tokenizer"
        )
        raise DrafterError(msg)


def _build_draft_model(opened: OpenedModel, path: Path) -> DrafterSetup:
    from turbospark_core.loader import open_install, refuse_non_install
    from turbospark_core.manifest import load_manifest
    from turbospark_core.speculative.draft_model import ModelDrafter

    options = opened.options
    k = draft_length(options)
    try:
        refuse_non_install(Path(path))
        draft_manifest = load_manifest(Path(path))
    except InstallError as e:
        raise type(e)(f"draft_model={str(path)!r} cannot be opened: {e}") from None
    refuse_vocab_mismatch(opened.manifest, draft_manifest)
    refuse_hadamard(draft_manifest, options, role="draft_model ")
    left = options.memory_budget - opened.estimate.total  # the draft opens in what the target leaves
    draft_options = attrs.evolve(
        options,
        draft_model=None,
        num_draft_tokens=None,
        max_context=opened.max_context,
        steering=None,
        router_histogram=False,
        ffn_histogram=False,
        vision=None,
        memory_budget=max(left, 1),
    )
    try:
        draft = open_install(path, draft_options, ring_slack=k + 1)
    except MemoryBudgetError as e:
        msg = (
            f"draft_model={str(path)!r} does not fit beside the model: the model needs "
            f"~{opened.estimate.total / 1e9:.2f} GB of memory_budget={options.memory_budget / 1e9:.2f} GB, "
            f"leaving {max(left, 0) / 1e9:.2f} GB, and the draft model (its KV counted for every session slot) {e}; "
            f"or open without draft_model"
        )
        raise MemoryBudgetError(msg) from None
    model, new_cache = draft.model, draft.new_cache
    cost = draft.estimate.weights / max(opened.estimate.weights, 1)
    return DrafterSetup(
        name="draft_model",
        new=lambda: ModelDrafter(model, new_cache),
        num_draft_tokens=k,
        draft_cost=cost,
        adaptive=options.num_draft_tokens is None,
        description=(
            f"draft_model {draft.manifest.root} ({draft.capabilities.family}, "
            f"up to {k} tokens per verify, {cost:.2f}x the target's weights)"
        ),
        draft=draft,
        memory=draft.estimate.total,
    )


# ------------------------------------------------------------------ dflash
def _build_dflash(opened: OpenedModel, path: Path) -> DrafterSetup:
    from turbospark_core.speculative.dflash import setup_dflash

    return setup_dflash(opened, path, draft_length(opened.options))


def _dflash_length(path: Path) -> int:
    from turbospark_core.speculative.dflash import default_draft_length

    return default_draft_length(path)


# ------------------------------------------------------------------ mtp
def _build_mtp(opened: OpenedModel, requested: int | str) -> DrafterSetup | None:
    from turbospark_core.speculative import mtp

    return mtp.build_setup(opened, requested)


def _mtp_length(requested: int | str) -> int:
    from turbospark_core.speculative import mtp

    return mtp.default_length(requested)


BUILDERS: dict[str, Builder] = {
    "dflash": _build_dflash,
    "draft_model": _build_draft_model,
    "ngram": _build_ngram,
    "mtp": _build_mtp,
}
DEFAULT_LENGTH: dict[str, Callable[[Any], int]] = {
    "dflash": _dflash_length,
    "draft_model": lambda _path: DEFAULT_DRAFT_MODEL_TOKENS,
    "ngram": int,
    "mtp": _mtp_length,
}
