"""The open sequence: from an install path to a ready model, each step a named refusal."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from turbospark_core import hadamard, kernel_speed, native, placement, plugins
from turbospark_core.arch_check import generic_problems
from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.compute import GPU_COMPUTE_DTYPE, ComputePolicy
from turbospark_core.context import Capabilities, FamilyContext, FamilyModel
from turbospark_core.diagnostics import Diagnostics
from turbospark_core.distributed.setup import DistributedInfo, DistributedOpen, prepare
from turbospark_core.errors import (
    ArchConfigError,
    FamilyRefusalError,
    FileTableError,
    InstallError,
    MemoryBudgetError,
    NotAnInstallError,
    OptionError,
)
from turbospark_core.experts.layout import ExpertLayout
from turbospark_core.experts.plan import (
    RESIDENT,
    STREAMED,
    ExpertPlan,
    check_slots,
    minimal_plan,
    plan_experts,
    refuse_streaming_without_file,
    residencies,
)
from turbospark_core.experts.store import ExpertStore
from turbospark_core.kv_cache import KV_BITS, Cache, kv_group_size, kv_recent_default, make_caches
from turbospark_core.manifest import (
    EXPERTS,
    HADAMARD,
    MANIFEST,
    MODEL_KIND,
    WEIGHTS,
    Manifest,
    check_files,
    load_manifest,
    parse_json,
    verify_checksums,
)
from turbospark_core.memory import MemoryEstimate
from turbospark_core.options import OpenOptions
from turbospark_core.placement import Placement
from turbospark_core.sessions import SessionPool
from turbospark_core.speculative.factory import DrafterSetup, draft_length, make_drafter, refuse_hadamard
from turbospark_core.stats import PhaseTimer, StartupStats
from turbospark_core.steering import DirectionSet
from turbospark_core.tensor_index import TensorIndex, build_index
from turbospark_core.thread_exit import note_thread
from turbospark_core.tokenizer import Tokenizer
from turbospark_core.weights import WeightStore

DEFAULT_MAX_CONTEXT = 8192


@attrs.frozen(kw_only=True)
class OpenedModel:
    """Everything :class:`~turbospark_core.runner.Runner` needs, built by :func:`open_install`.

    Attributes:
        new_cache: Makes fresh per-layer caches for one sequence.
        sessions: The session pool (open step 13).
        steering: The direction set of open step 14 (``None``: unsteered),
            applied to every request that names none.
        distributed: This rank's mode and share (``None``: one process).
        tokenizer: The install's tokenizer, when the open was asked to read it.
        placement: What the end of step 8 did with the weights' pages
            (:mod:`turbospark_core.placement`).
    """

    manifest: Manifest
    hooks: plugins.FamilyHooks = attrs.field(eq=False, repr=False)
    index: TensorIndex
    options: OpenOptions
    policy: ComputePolicy
    capabilities: Capabilities
    model: FamilyModel = attrs.field(eq=False)
    cache_layout: tuple[CacheSpec | StateSpec, ...]
    new_cache: Callable[[], list[Cache]] = attrs.field(eq=False, repr=False)
    sessions: SessionPool = attrs.field(eq=False, repr=False)
    max_context: int
    estimate: MemoryEstimate
    startup_stats: StartupStats
    generation_config: dict[str, Any]
    experts: ExpertStore | None = attrs.field(default=None, eq=False)
    diagnostics: Diagnostics | None = attrs.field(default=None, eq=False, repr=False)
    steering: DirectionSet | None = attrs.field(default=None, eq=False)
    weights: WeightStore | None = attrs.field(default=None, eq=False, repr=False)
    drafter: DrafterSetup | None = attrs.field(default=None, eq=False)
    distributed: DistributedInfo | None = None
    tokenizer: Tokenizer | None = attrs.field(default=None, eq=False, repr=False)
    placement: Placement = attrs.field(factory=lambda: Placement(reason="not placed"))


def refuse_non_install(path: Path) -> None:
    """Step 1: vision sidecars, checkpoints and GGUF files are not installs."""
    if not path.exists():
        msg = f"{path} does not exist; pass an install directory made by `turbospark convert`"
        raise InstallError(msg)
    if path.is_file():
        kind = "a GGUF file" if path.suffix == ".gguf" else "a file"
        sidecar = "mmproj" in path.name.lower()
        what = "a vision sidecar (mmproj), not a language model" if sidecar else kind
        msg = f"{path} is {what}, not a turbospark install; convert it with `turbospark convert {path} DST`"
        if sidecar:
            msg = f"{path} is {what}; pass the text model's install instead"
        raise NotAnInstallError(msg)
    _refuse_vision_sidecar(path)
    if not (path / MANIFEST).exists() and (path / "config.json").exists():
        msg = (
            f"{path} is a Hugging Face / mlx-lm checkpoint, not a turbospark install; "
            f"make one with `turbospark convert {path} DST` and open DST"
        )
        raise NotAnInstallError(msg)


def _refuse_vision_sidecar(path: Path) -> None:
    manifest = path / MANIFEST
    if manifest.is_file() and manifest.stat().st_size < 1 << 20:
        try:
            raw = json.loads(manifest.read_bytes())
        except (ValueError, RecursionError):  # bad JSON/UTF-8, huge integers, nesting bombs
            return  # the manifest step reports it
        if isinstance(raw, dict) and (raw.get("sidecar") == "vision" or "vision" in str(raw.get("format", ""))):
            msg = (
                f"{path} is a vision sidecar, not a language model install; "
                "open the text model's install and attach the sidecar to it "
                "(open(INSTALL, vision=SIDECAR), --vision SIDECAR)"
            )
            raise NotAnInstallError(msg)
    config = path / "config.json"
    if not manifest.exists() and config.is_file() and config.stat().st_size < 1 << 20:
        try:
            model_type = str(json.loads(config.read_bytes()).get("model_type", ""))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return
        text_config = ("text_config" in json.loads(config.read_bytes())) if model_type else False
        pixel_only = (
            (path / "preprocessor_config.json").exists() and not text_config and not list(path.glob("tokenizer*"))
        )
        if "vision" in model_type or pixel_only:
            msg = (
                f"{path} is a vision sidecar (model_type {model_type!r}), not a language model; "
                "open the text model's install instead"
            )
            raise NotAnInstallError(msg)


def refuse_drafter_install(manifest: Manifest) -> None:
    """A drafter install (manifest kind other than ``"model"``) opens only beside its target."""
    if manifest.kind != MODEL_KIND:
        msg = (
            f"{manifest.root} is a {manifest.kind!r} drafter install, not a language model; open its target "
            f"model and pass {manifest.kind}={str(manifest.root)!r}"
        )
        raise NotAnInstallError(msg)


def _check_arch(arch: dict[str, Any], hooks: plugins.FamilyHooks) -> None:
    """Step 3: the core's generic checks (types, bounds, consistency), then the family's.

    The family is asked only once the generic keys hold, so its checks may rely on them.
    """
    problems = generic_problems(arch)
    if not problems:
        problems = hooks.arch_problems(arch)
    if problems:
        msg = f"arch config of model type {arch['model_type']!r} is invalid: " + "; ".join(problems)
        raise ArchConfigError(msg)


def _verify(manifest: Manifest) -> None:
    """``verify=True``: every file in the table has a recorded sha256, and its bytes match it."""
    unrecorded = sorted(name for name, entry in manifest.files.items() if not entry.sha256)
    if unrecorded:
        msg = (
            f"{manifest.root}: verify=True, but the file table records no sha256 for "
            f"{', '.join(map(repr, unrecorded))}; re-run `turbospark convert` (or open without verify)"
        )
        raise FileTableError(msg)
    bad = verify_checksums(manifest)
    if bad:
        msg = (
            f"{manifest.root}: the sha256 of {', '.join(map(repr, bad))} differs from the file table; "
            f"the install is corrupt or altered, re-run `turbospark convert`"
        )
        raise FileTableError(msg)


def _check_kv_quant(arch: dict[str, Any], hooks: plugins.FamilyHooks, kv_quant: str | None) -> None:
    """Step 4."""
    if kv_quant is None:
        return
    reason = hooks.kv_quant_unsupported_reason(arch, kv_quant)
    if reason:
        msg = f"kv_quant={kv_quant!r} refused by family {hooks.spec.name!r}: {reason}"
        raise FamilyRefusalError(msg)


def _check_kv_groups(layout: tuple[CacheSpec | StateSpec, ...], kv_quant: str | None) -> None:
    """Quantized KV rows need a head dimension that a quantization group (32/64) divides."""
    if kv_quant is None:
        return
    for i, spec in enumerate(layout):
        dims = [] if isinstance(spec, StateSpec) else [spec.head_dim, spec.v_head_dim or spec.head_dim]
        bad = [d for d in dims if kv_group_size(d) is None]
        if bad:
            msg = (
                f"kv_quant={kv_quant!r} needs head dims divisible by 32, but cache {i} has "
                f"head_dim {bad[0]}; open with kv_quant=None"
            )
            raise OptionError(msg)


def _check_hadamard(manifest: Manifest, hooks: plugins.FamilyHooks, capabilities: Capabilities) -> None:
    """Step 6: a family that does not accept the section refuses; else the section and file are checked."""
    section = manifest.hadamard
    if section is None:
        return
    if not capabilities.accepts_hadamard:
        msg = (
            f"{manifest.root} is hadamard-folded, and family {hooks.spec.name!r} "
            f"(model type {manifest.model_type!r}) does not accept hadamard-folded installs; "
            f"re-convert without hadamard folding"
        )
        raise FamilyRefusalError(msg)
    path = manifest.path(HADAMARD)
    parsed = hadamard.parse_section(section, manifest.arch, str(manifest.root / MANIFEST))
    if parsed.size != manifest.files[HADAMARD].size:
        msg = f"{path}: hadamard section says {parsed.size} bytes, file table says {manifest.files[HADAMARD].size}"
        raise InstallError(msg)
    hadamard.read_signs(path, parsed)


def _generation_config(root: Path, manifest: Manifest) -> dict[str, Any]:
    name = "generation_config.json"
    if name not in manifest.files:
        return {}
    raw = parse_json((root / name).read_bytes()[: manifest.files[name].size], root / name, InstallError)
    return raw if isinstance(raw, dict) else {}


def open_install(
    path: str | Path,
    options: OpenOptions,
    *,
    ring_slack: int | None = None,
    store: Callable[[Path, TensorIndex, ComputePolicy], WeightStore] | None = None,
    tokenizer: bool = False,
) -> OpenedModel:
    """Open an install: the design's open sequence, each step a named refusal.

    :func:`turbospark_core.open` does steps 1 and 2 first: it refuses what is
    not an install (:func:`refuse_non_install`: a missing path, a file, a
    checkpoint, a vision sidecar), then builds ``options``, which checks them.
    The steps here, in this order:

    5. load the manifest (bounded) and find the plugin serving its model type
       (before 3 and 4: the arch lives in the manifest);
    3. check the arch config (the core's generic checks, then the family's);
    4. ask the family about ``kv_quant``;
       then ask the family's probes once (:class:`Capabilities`);
    6. check the hadamard section; a family that does not accept it refuses;
    7. read the tensor index and the family's cache layout; read the experts
       section (10's layout); estimate memory (weights + KV at max_context x
       session_slots + expert slots) and refuse an over-budget open;
    then, with ``tokenizer``, read the tokenizer (:class:`~turbospark_core.tokenizer.Tokenizer`,
    into ``OpenedModel.tokenizer``): before the weights are held, so the open's peak
    memory is the larger of the two rather than their sum (its parse peaks at about
    three times what it keeps, and hands the rest back);
    8. map the weights;
    9. KV cache and scratch: nothing is allocated at open (caches grow per
       sequence, see ``OpenedModel.new_cache``), so no phase times it;
    10. set up the experts (resident banks, or streamed slots);
    11. build the family state (``build_family_state``), then materialize;
        with a diagnostic on (``router_histogram``, ``ffn_histogram``), the
        weight store of step 8 hands out recording objects, and one that
        observes nothing is refused here (:mod:`turbospark_core.diagnostics`);
    12. drafters (:mod:`turbospark_core.speculative.factory`): at most one
        (``OpenOptions`` refused two); a hadamard-folded install refuses any
        (checked with step 6); the named drafter is built last, from the
        opened target (a draft model is another install opened here, in the
        memory the target leaves); what it holds (weights, its per-sequence
        state for every session slot) joins the estimate (``drafter``) and
        an over-budget drafter is refused naming the knobs;
    13. build the session pool (``session_slots`` parked sequences);
    14. steering (``options.steering``): read the direction set (bounded
        reads, or the in-memory :class:`DirectionSet`), check it against the
        arch (hidden size, layer range, values); a family whose
        ``steering_supported`` gave a reason refuses it by name;
    15. warm-up (one token), when ``options.warmup`` (diagnostics forget it).

    Distributed (``options.distributed`` in a group of several processes, see
    :mod:`turbospark_core.distributed`): after 10's layout the rank's share is
    computed, every split refused first (:func:`~turbospark_core.distributed.setup.prepare`);
    7's estimate counts only that share, and the ranks agree on the compute
    policy; 8 reads only the rank's byte ranges; 10 reads only its experts'
    records; 11 builds the flow from the per-rank arch (pipeline ranks then get
    relays for other ranks' layers); the shape check runs, evaluated, on every
    rank; MLX's generator is seeded alike on every rank. In a group of one
    process none of this happens.

    Timed into :class:`StartupStats`: manifest_index (5, 3, 4, 6, 7 but the
    estimate), tokenizer, expert_setup (the experts section, 10), weights_mapping (8, and
    materializing after 11), family_state (11), session_state (13), steering
    (14, when asked), warmup (15), drafter (12), and total_open (all of this function).

    ``ring_slack``: spare sliding-window ring slots (default: the drafted
    tokens per verify + 1 when a drafter is named, so rejected drafts are
    trimmed without losing the window).

    ``store``: makes step 8's weight store in place of :class:`WeightStore` (``convert --calibrate``
    opens its float model with one that records each linear's inputs); not with a diagnostic on.
    """
    root = Path(path)
    timer = PhaseTimer()
    with timer.phase("manifest_index"):
        manifest = load_manifest(root)  # 5
        refuse_drafter_install(manifest)
        hooks = plugins.family_hooks(manifest.model_type, distribution=manifest.distribution)
        _check_arch(manifest.arch, hooks)  # 3
        _check_kv_quant(manifest.arch, hooks, options.kv_quant)  # 4
        capabilities = _probe(manifest.arch, hooks)
        check_files(manifest)
        if options.verify:
            _verify(manifest)
        _check_hadamard(manifest, hooks, capabilities)  # 6
        refuse_hadamard(manifest, options)  # 12's refusal, before anything is mapped
        index = build_index(manifest.path(WEIGHTS), manifest.files[WEIGHTS].size, manifest.quantization)  # 7
        layout = hooks.cache_layout(manifest.arch) or ()
        _check_kv_groups(layout, options.kv_quant)
    max_context = _max_context(manifest.arch, options)
    with timer.phase("expert_setup"):
        expert_layout = _expert_layout(manifest, index, options)  # 10, read before the estimate that counts slots
    with timer.phase("manifest_index"):
        dist = prepare(manifest, hooks, index, expert_layout, options)  # None: one process
        arch = manifest.arch if dist is None else dist.arch
        if dist is not None:  # this rank's head counts (tensor parallelism)
            layout = hooks.cache_layout(arch) or ()
            _check_kv_groups(layout, options.kv_quant)
    held_index, held_experts, held_layout = (
        (index, expert_layout, layout)
        if dist is None
        else (dist.held_index(), dist.held_experts(), dist.held_layout(layout))
    )
    slack = draft_length(options) + 1 if ring_slack is None and options.drafters_named() else ring_slack or 0
    policy, plan, estimate = _plan_memory(held_index, held_experts, held_layout, options, max_context, dist, slack)
    diagnostics = Diagnostics.from_options(options)  # None unless asked for: then nothing is wrapped
    generation_config = _generation_config(root, manifest)
    read_tokenizer: Tokenizer | None = None
    if tokenizer:
        with timer.phase("tokenizer"):
            read_tokenizer = Tokenizer.from_install(
                root, generation_config, lambda: hooks.default_chat_template(manifest.arch)
            )
    with timer.phase("weights_mapping"):
        if dist is not None:
            weights = dist.weights(policy)  # 8: only this rank's byte ranges are read
        elif diagnostics is None:
            weights = (store or WeightStore)(manifest.path(WEIGHTS), index, policy)  # 8
        else:
            weights = diagnostics.weights(manifest.path(WEIGHTS), index, policy)
    with timer.phase("expert_setup"):
        experts = _open_experts(manifest, held_experts, plan, policy)  # 10
        weights.use_experts(experts)
    with timer.phase("family_state"):
        model = _build_family(manifest, hooks, weights, layout, policy, arch)  # 11
        if diagnostics is not None:
            model = diagnostics.attach(model, manifest.model_type, experts)
        if dist is not None:
            model = dist.finish(model, hooks.spec.name)
    with timer.phase("weights_mapping"):
        weights.materialize()
        pages = placement.place(model)
    new_cache = _cache_maker(held_layout, max_context, policy, options, slack)
    if dist is not None and not options.warmup:  # every rank runs (and evaluates) the same check
        with timer.phase("family_state"):
            _forward_one(model, new_cache, manifest, hooks, evaluate=True)
    elif not options.warmup and (plan is None or plan.residency != STREAMED):
        with timer.phase("family_state"):
            _forward_one(model, new_cache, manifest, hooks, evaluate=False)  # 11: shapes checked, nothing computed
    with timer.phase("session_state"):
        sessions = SessionPool(options.session_slots, new_cache)  # 13
    steering = None
    if options.steering is not None:
        with timer.phase("steering"):
            steering = open_steering(options.steering, manifest.arch, capabilities)  # 14
    if options.warmup:
        with timer.phase("warmup"):
            _forward_one(model, new_cache, manifest, hooks, evaluate=True)  # 15
    if diagnostics is not None:
        diagnostics.reset()  # neither the shape check nor the warm-up token is counted
    opened = OpenedModel(
        manifest=manifest,
        hooks=hooks,
        index=index,
        options=options,
        policy=policy,
        capabilities=capabilities,
        model=model,
        cache_layout=layout,
        new_cache=new_cache,
        sessions=sessions,
        max_context=max_context,
        estimate=estimate,
        startup_stats=timer.finish(),
        generation_config=generation_config,
        tokenizer=read_tokenizer,
        experts=experts,
        diagnostics=diagnostics,
        steering=steering,
        weights=weights,
        distributed=None if dist is None else dist.info(),
        placement=pages,
    )
    if dist is not None:
        dist.seed()  # unseeded sampling draws alike on every rank
    if not options.drafters_named():
        return opened
    with timer.phase("drafter"):
        drafter = make_drafter(opened)  # 12: each drafter checks its memory against what the model leaves
    counted = estimate if drafter is None else attrs.evolve(estimate, drafter=drafter.memory)
    return attrs.evolve(opened, drafter=drafter, estimate=counted, startup_stats=timer.finish())


def _forward_one(
    model: FamilyModel,
    new_cache: Callable[[], list[Cache]],
    manifest: Manifest,
    hooks: plugins.FamilyHooks,
    *,
    evaluate: bool,
) -> None:
    """One token through the model: the warm-up (``evaluate``), or only its graph, which MLX shape-checks
    as it is built (so an arch config that passes every check but does not fit the tensors is refused here,
    not at the first request).

    Raises:
        InstallError: The flow's shapes do not fit the install's tensors, naming the family and the op.
    """
    note_thread()  # see thread_exit
    try:
        logits = model(mx.array([[0]]), new_cache())
        if evaluate:
            mx.eval(logits)
    except (ValueError, TypeError, IndexError) as e:  # MLX refuses mismatched shapes with ValueError
        msg = (
            f"{manifest.root}: the tensors do not fit the arch config of model type {manifest.model_type!r} "
            f"as family {hooks.spec.name!r} reads it ({str(e)[:300]}); the arch config was altered, "
            f"re-run `turbospark convert`"
        )
        raise InstallError(msg) from None


def _probe(arch: dict[str, Any], hooks: plugins.FamilyHooks) -> Capabilities:
    """The family's answers, asked once at open and read by the open sequence and ``inspect``."""
    return Capabilities(
        family=hooks.spec.name,
        distribution=hooks.spec.distribution,
        accepts_hadamard=hooks.accepts_hadamard(arch),
        steering_refusal=hooks.steering_supported(arch),
    )


def open_steering(
    requested: Path | DirectionSet | None, arch: dict[str, Any], capabilities: Capabilities
) -> DirectionSet | None:
    """Step 14 (and every per-request set): the family must apply edits; the set must fit the arch.

    Raises:
        FamilyRefusalError: The family's ``steering_supported`` gave a reason.
        SteeringError: The file is bad or the set does not fit (a subclass naming why).
    """
    if requested is None:
        return None
    refuse_steering(arch, capabilities)
    found = requested if isinstance(requested, DirectionSet) else DirectionSet.load(requested)
    found.check(arch)
    return found


def refuse_steering(arch: dict[str, Any], capabilities: Capabilities) -> None:
    """Raise the family's steering refusal, if it gave one."""
    if capabilities.steering_refusal is not None:
        msg = (
            f"steering refused by family {capabilities.family!r} ({capabilities.distribution}, model type "
            f"{arch.get('model_type')!r}): {capabilities.steering_refusal}"
        )
        raise FamilyRefusalError(msg)


def _cache_maker(
    layout: tuple[CacheSpec | StateSpec, ...],
    max_context: int,
    policy: ComputePolicy,
    opts: OpenOptions,
    ring_slack: int = 0,
) -> Callable[[], list[Cache]]:
    """Makes fresh per-layer caches for one sequence (allocated as the sequence grows)."""
    kv_bits, kv_recent = _kv_storage(opts)
    return functools.partial(
        make_caches,
        list(layout),
        max_context,
        policy.compute_dtype,
        opts.ring_capacity,
        kv_bits,
        opts.kv_rotate,
        ring_slack,
        kv_recent,
    )


def _kv_storage(opts: OpenOptions) -> tuple[int | None, int]:
    """The KV bits (``None``: unquantized) and how many recent tokens attention reads exact."""
    kv_bits = None if opts.kv_quant is None else KV_BITS[opts.kv_quant]
    return kv_bits, kv_recent_default(kv_bits) if opts.kv_recent is None else opts.kv_recent


def _plan_memory(
    index: TensorIndex,
    expert_layout: ExpertLayout | None,
    layout: tuple[CacheSpec | StateSpec, ...],
    opts: OpenOptions,
    max_context: int,
    dist: DistributedOpen | None = None,
    ring_slack: int = 0,
) -> tuple[ComputePolicy, ExpertPlan | None, MemoryEstimate]:
    """Step 7's estimate: the compute policy and expert plan that fit, or an over-budget refusal.

    Distributed: ``index``, ``expert_layout`` and ``layout`` are this rank's
    share (the guard applies per rank), and the ranks agree on the policy (one
    that cannot unpack keeps every rank's weights stored: they compute alike).
    """
    bits, recent = _kv_storage(opts)
    itemsize = 4 if bits is None else bits / 8 + 8 / (32 if bits == 4 else 64)  # + scales/biases per group
    per_sequence = int(sum(spec.bytes_at(max_context, itemsize, ring_capacity=opts.ring_capacity) for spec in layout))
    if bits is not None and recent:  # the recent tokens' exact ring (window + the verify's spare slots)
        exact = [attrs.evolve(s, window=recent + ring_slack) for s in layout if isinstance(s, CacheSpec)]
        per_sequence += int(sum(spec.bytes_at(max_context, 4) for spec in exact))
    kv_bytes = per_sequence * opts.session_slots
    policy, plan = _choose_policy(index, expert_layout, opts, kv_bytes)
    if dist is not None and not dist.agree(policy.unpack):
        policy, plan = _choose_policy(index, expert_layout, opts, kv_bytes, unpack=False)
    weight_bytes = _unpacked_bytes(index) if policy.unpack else _stored_bytes(index)
    estimate = MemoryEstimate(weights=weight_bytes, kv=kv_bytes, experts=0 if plan is None else plan.held_bytes)
    try:
        _check_expert_budget(estimate, plan, opts, max_context)
        estimate.check(opts.memory_budget, max_context=max_context, slots=opts.session_slots)
    except MemoryBudgetError as e:
        if dist is None:
            raise
        info = dist.info()
        msg = f"rank {info.rank} of {info.size} ({info.mode} parallel, {info.share}): {e}, or launch more ranks"
        raise MemoryBudgetError(msg) from None
    return policy, plan, estimate


def _unpacked_bytes(index: TensorIndex) -> int:
    """Weight bytes under the CPU's unpacking policy: float32, except the quantized
    matrices (and expert stacks) whose layout stays quantized for the native kernels
    (faster than float32 on this machine, :mod:`turbospark_core.kernel_speed`)."""
    return index.float_bytes(4, keep=lambda base, spec: kernel_speed.stays_quantized(spec))


def _stored_bytes(index: TensorIndex) -> int:
    """Weight bytes under the stored-form policy: as stored, except narrow-group matrices
    (no MLX kernel) that the native kernels do not multiply, unpacked to the compute dtype."""
    itemsize = (mx.float32 if mx.default_device() == mx.cpu else GPU_COMPUTE_DTYPE).size
    return index.stored_bytes(
        unpack=lambda base, spec: not spec.mlx_kernels and not native.keeps(spec), itemsize=itemsize
    )


def _expert_layout(manifest: Manifest, index: TensorIndex, opts: OpenOptions) -> ExpertLayout | None:
    """Step 10: the ``experts`` section validated against experts.bin's size and the slot option."""
    if manifest.experts is None:
        refuse_streaming_without_file(index.tensors, opts.residency)
        return None
    path = manifest.path(EXPERTS)
    layout = ExpertLayout.from_section(manifest.experts, manifest.files[EXPERTS].size, str(path))
    if opts.residency != RESIDENT:
        check_slots(layout, opts.expert_slots)
    return layout


def _choose_policy(
    index: TensorIndex, layout: ExpertLayout | None, opts: OpenOptions, kv_bytes: int, unpack: bool = True
) -> tuple[ComputePolicy, ExpertPlan | None]:
    """The compute policy and, for MoE installs, the expert plan: float32 resident, stored resident,
    float32 streamed, stored streamed, the first that fits the budget (residency permitting;
    ``unpack=False``: only the stored forms)."""
    room = max(0, opts.memory_budget - kv_bytes)
    f32, stored = _unpacked_bytes(index), _stored_bytes(index)
    if layout is None:
        return ComputePolicy.choose(unpacked_bytes=f32, stored_bytes=stored, budget=room, unpack=unpack), None
    for residency in residencies(opts.residency, opts.expert_slots, layout):
        as_f32 = plan_experts(layout, residency, opts.expert_slots, room - f32, unpack=True) if unpack else None
        as_stored = plan_experts(layout, residency, opts.expert_slots, room - stored, unpack=False)
        if as_f32 is not None or as_stored is not None:
            break
    f32_plan = as_f32 or minimal_plan(layout, residency, opts.expert_slots, unpack=True)
    stored_plan = as_stored or minimal_plan(layout, residency, opts.expert_slots, unpack=False)
    policy = ComputePolicy.choose(
        unpacked_bytes=f32 + f32_plan.held_bytes,
        stored_bytes=stored + stored_plan.held_bytes,
        budget=room,
        unpack=unpack,
    )
    return policy, f32_plan if policy.unpack else stored_plan


def _check_expert_budget(
    estimate: MemoryEstimate, plan: ExpertPlan | None, opts: OpenOptions, max_context: int
) -> None:
    """An over-budget MoE open names the expert knobs too."""
    if plan is None or estimate.total <= opts.memory_budget:
        return
    if plan.residency != STREAMED:
        knob = "open with residency='streamed' (or 'auto') to keep only some experts in memory"
    elif isinstance(opts.expert_slots, int):
        knob = f"lower expert_slots (now {opts.expert_slots})"
    else:
        knob = f"even the fewest workable slots ({plan.slots} per layer, the model's top_k) do not fit"
    msg = (
        f"opening needs ~{estimate.total / 1e9:.2f} GB (weights {estimate.weights / 1e9:.2f} GB, "
        f"KV at max_context={max_context} x {opts.session_slots} slot(s) {estimate.kv / 1e9:.2f} GB, "
        f"experts {plan.describe()}) but memory_budget is {opts.memory_budget / 1e9:.2f} GB; "
        f"{knob}, lower max_context or session_slots, or raise memory_budget"
    )
    raise MemoryBudgetError(msg)


def _open_experts(
    manifest: Manifest, layout: ExpertLayout | None, plan: ExpertPlan | None, policy: ComputePolicy
) -> ExpertStore | None:
    """Step 10: read every expert (resident) or set up the slot reads (streamed)."""
    if layout is None or plan is None:
        return None
    store = ExpertStore(manifest.path(EXPERTS), layout, plan, policy)
    store.setup()
    return store


def _max_context(arch: dict[str, Any], opts: OpenOptions) -> int:
    limit = arch.get("max_position_embeddings")
    if opts.max_context is not None:
        return opts.max_context
    return min(int(limit), DEFAULT_MAX_CONTEXT) if isinstance(limit, int) and limit > 0 else DEFAULT_MAX_CONTEXT


def _build_family(
    manifest: Manifest,
    hooks: plugins.FamilyHooks,
    weights: WeightStore,
    layout: tuple[CacheSpec | StateSpec, ...],
    policy: ComputePolicy,
    arch: dict[str, Any] | None = None,
) -> FamilyModel:
    context = FamilyContext(
        arch=manifest.arch if arch is None else arch,
        weights=weights,
        cache_layout=layout,
        compute_dtype=policy.compute_dtype,
    )
    model = hooks.build_family_state(context)
    if model is None:
        msg = (
            f"plugin for family {hooks.spec.name!r} ({hooks.spec.distribution}) returned no "
            f"model for model type {manifest.model_type!r}; the plugin is broken, reinstall it"
        )
        raise InstallError(msg)
    unused = weights.unused()
    if unused:
        msg = (
            f"{manifest.root}: {len(unused)} tensor(s) are not used by family "
            f"{hooks.spec.name!r}, first {unused[0]!r}; the install does not match its arch "
            f"config, re-run `turbospark convert`"
        )
        raise InstallError(msg)
    return model
