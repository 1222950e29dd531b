"""The plugin manager: lazy entry-point loading and a typed facade over the hooks."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import threading
from typing import TYPE_CHECKING, Any

import pluggy
from pluggy import HookCaller

from turbospark_core import hookspecs
from turbospark_core.errors import PluginError, UnknownFamilyError
from turbospark_core.hookspecs import Arch
from turbospark_core.names import NAME
from turbospark_core.registry import Claim, FamilyRegistry

if TYPE_CHECKING:
    from turbospark_core.cache_spec import CacheSpec, StateSpec
    from turbospark_core.context import DraftHead, FamilyContext, FamilyModel, HeadContext
    from turbospark_core.convert.records import TensorTarget
    from turbospark_core.distributed.plan import DistributedPlan
    from turbospark_core.hadamard import ResidualMap
    from turbospark_core.vision.tower import VisionContext, VisionSpec, VisionTower

ALLOW_LIST_ENV = "TURBOSPARK_PLUGINS"

pm = pluggy.PluginManager(NAME)
pm.add_hookspecs(hookspecs)

_lock = threading.Lock()
_loaded = False


def _allowed() -> set[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return sorted(importlib.metadata.entry_points(group=NAME), key=lambda ep: ep.name)


def load_plugins() -> None:
    """Load every ``turbospark`` entry point once (idempotent, thread-safe).

    ``TURBOSPARK_PLUGINS`` (comma-separated entry-point names, may be empty)
    restricts which are loaded.

    Raises:
        PluginError: An entry point failed to import, or declares a hookimpl
            that matches no hookspec.
    """
    global _loaded
    with _lock:
        if _loaded:
            return
        allowed = _allowed()
        for ep in _entry_points():
            if allowed is not None and ep.name not in allowed:
                continue
            if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
                continue
            pm.register(_import_entry_point(ep), name=ep.name)
        _check_pending()
        _loaded = True


def _import_entry_point(ep: importlib.metadata.EntryPoint) -> object:
    try:
        return ep.load()
    except Exception as e:  # re-raised with the entry point named
        dist = ep.dist.name if ep.dist is not None else "?"
        msg = (
            f"turbospark plugin entry point {ep.name!r} ({ep.value}, from "
            f"distribution {dist!r}) failed to import: {type(e).__name__}: {e}; "
            f"reinstall or uninstall {dist!r}, or leave it out of {ALLOW_LIST_ENV}"
        )
        raise PluginError(msg) from e


def _check_pending() -> None:
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        msg = f"a turbospark plugin declares a hook that does not exist: {e}"
        raise PluginError(msg) from e


def reset_plugins() -> None:
    """Forget the loaded state so the next :func:`load_plugins` reloads (tests)."""
    global _loaded
    with _lock:
        for name, plugin in list(pm.list_name_plugin()):
            if plugin is not hookspecs:
                pm.unregister(name=name)
        _loaded = False


def registry() -> FamilyRegistry:
    """The family registry built from every loaded plugin's ``register_families``.

    Each plugin's implementation is called through its own pluggy subset
    caller (so hook-call monitoring sees it) with a ``register`` callback that
    knows which plugin is registering. Built anew on each call (cheap), so
    plugins registered or unregistered since (tests, allow-list changes) are
    always reflected.
    """
    load_plugins()
    reg = FamilyRegistry()
    everyone = pm.get_plugins()
    for impl in pm.hook.register_families.get_hookimpls():
        only = _subset(pm.hook.register_families, [p for p in everyone if p is not impl.plugin])
        only(register=functools.partial(reg.add, plugin_name=impl.plugin_name, plugin=impl.plugin))
    return reg


def _subset(hook: HookCaller, remove: list[object]) -> HookCaller:
    """``hook`` without the implementations of ``remove`` (a pluggy subset caller)."""
    return pm.subset_hook_caller(hook.name, remove_plugins=remove)


class FamilyHooks:
    """Typed facade over the hooks of the one plugin that serves a family.

    Every call goes through pluggy (a subset caller holding only that plugin),
    so hook-call monitoring and tracing see it; no other plugin is asked.
    """

    def __init__(self, claim: Claim) -> None:
        self.spec = claim.spec
        self._others = [p for p in pm.get_plugins() if p is not claim.plugin]

    def _mine(self, hook: HookCaller) -> HookCaller:
        return _subset(hook, self._others)

    # ------------------------------------------------------------ conversion
    def arch_from_hf_config(self, hf_config: dict[str, Any]) -> Arch | None:
        """The install's arch config for a Hugging Face ``config.json``."""
        arch: Arch | None = self._mine(pm.hook.arch_from_hf_config)(hf_config=hf_config)
        return arch

    def arch_from_gguf(self, architecture: str, metadata: dict[str, Any], tensor_names: list[str]) -> Arch | None:
        """The install's arch config for a GGUF file's metadata."""
        arch: Arch | None = self._mine(pm.hook.arch_from_gguf)(
            architecture=architecture, metadata=metadata, tensor_names=tensor_names
        )
        return arch

    def hf_tensor_target(self, arch: Arch, name: str) -> TensorTarget | None:
        """Where a Hugging Face tensor goes."""
        target: TensorTarget | None = self._mine(pm.hook.hf_tensor_target)(arch=arch, name=name)
        return target

    def hf_tensor_transform(self, arch: Arch, name: str, data: Any) -> dict[str, Any] | None:
        """Install tensors rewritten from one Hugging Face tensor, or ``None``."""
        rewritten: dict[str, Any] | None = self._mine(pm.hook.hf_tensor_transform)(arch=arch, name=name, data=data)
        return rewritten

    def gguf_tensor_target(self, arch: Arch, name: str) -> TensorTarget | None:
        """Where a GGUF tensor goes."""
        target: TensorTarget | None = self._mine(pm.hook.gguf_tensor_target)(arch=arch, name=name)
        return target

    # ------------------------------------------------------------ open: probes
    def arch_problems(self, arch: Arch) -> list[str]:
        """The family's own problems with ``arch`` (empty when valid)."""
        problems: list[str] | None = self._mine(pm.hook.arch_problems)(arch=arch)
        return list(problems or [])

    def kv_quant_unsupported_reason(self, arch: Arch, kv_quant: str) -> str | None:
        """Why quantized KV is refused, or ``None``."""
        reason: str | None = self._mine(pm.hook.kv_quant_unsupported_reason)(arch=arch, kv_quant=kv_quant)
        return reason

    def accepts_hadamard(self, arch: Arch) -> bool:
        """Whether a hadamard-folded install can be served (default: no)."""
        return bool(self._mine(pm.hook.accepts_hadamard)(arch=arch))

    def hadamard_residual_map(self, arch: Arch, names: list[str]) -> ResidualMap | None:
        """Which tensors read and write the residual stream (``convert --rotate``), or ``None``."""
        rmap: ResidualMap | None = self._mine(pm.hook.hadamard_residual_map)(arch=arch, names=names)
        return rmap

    def steering_supported(self, arch: Arch) -> str | None:
        """Why steering is refused, or ``None`` when the flow applies it (a plugin without the hook is refused)."""
        caller = self._mine(pm.hook.steering_supported)
        if not caller.get_hookimpls():
            return f"plugin {self.spec.distribution!r} does not implement the steering_supported hook"
        reason: str | None = caller(arch=arch)
        return reason

    def distributed_plan(self, arch: Arch) -> DistributedPlan | None:
        """How the family's model splits across ranks (``None``: it declares nothing)."""
        plan: DistributedPlan | None = self._mine(pm.hook.distributed_plan)(arch=arch)
        return plan

    def cache_layout(self, arch: Arch) -> tuple[CacheSpec | StateSpec, ...] | None:
        """The per-layer cache specs (``None`` when the plugin gives none)."""
        layout: list[CacheSpec | StateSpec] | None = self._mine(pm.hook.cache_layout)(arch=arch)
        return None if layout is None else tuple(layout)

    def default_chat_template(self, arch: Arch) -> str | None:
        """The family's chat template for installs without one."""
        template: str | None = self._mine(pm.hook.default_chat_template)(arch=arch)
        return template

    # ------------------------------------------------------------ open: build
    def build_family_state(self, context: FamilyContext) -> FamilyModel | None:
        """The family's model object."""
        model: FamilyModel | None = self._mine(pm.hook.build_family_state)(context=context)
        return model

    # ------------------------------------------------------------ vision sidecar
    def vision_arch_from_hf_config(self, hf_config: dict[str, Any]) -> VisionSpec | None:
        """The sidecar's description of the checkpoint's vision tower, or ``None`` (no vision flow)."""
        spec: VisionSpec | None = self._mine(pm.hook.vision_arch_from_hf_config)(hf_config=hf_config)
        return spec

    def vision_tensor_target(self, vision: dict[str, Any], name: str) -> TensorTarget | None:
        """Where a Hugging Face tensor goes in the sidecar."""
        target: TensorTarget | None = self._mine(pm.hook.vision_tensor_target)(vision=vision, name=name)
        return target

    def build_vision(self, context: VisionContext) -> VisionTower | None:
        """The family's vision tower for an attached sidecar, or ``None`` (no vision flow)."""
        tower: VisionTower | None = self._mine(pm.hook.build_vision)(context=context)
        return tower

    # ------------------------------------------------------------ drafters
    def has_mtp_head_flow(self) -> bool:
        """Whether the plugin implements ``build_mtp_head`` (a flow for multi-token-prediction heads)."""
        return bool(self._mine(pm.hook.build_mtp_head).get_hookimpls())

    def build_mtp_head(self, context: HeadContext) -> DraftHead | None:
        """The install's multi-token-prediction head (``None``: the plugin gave none)."""
        head: DraftHead | None = self._mine(pm.hook.build_mtp_head)(context=context)
        return head


def family_hooks(model_type: str, *, distribution: str | None = None) -> FamilyHooks:
    """The hooks of the plugin serving ``model_type``.

    Raises:
        UnknownFamilyError: No installed plugin serves it; the message names the
            installed families and the distribution to install.
    """
    reg = registry()
    claim = reg.claim(model_type)
    if claim is None:
        raise UnknownFamilyError(reg.refusal(model_type, distribution))
    return FamilyHooks(claim)


def arch_from_hf_config(hf_config: dict[str, Any]) -> Arch | None:
    """Ask the plugin serving ``hf_config["model_type"]`` to map it (``None``: no plugin serves it)."""
    model_type = hf_config.get("model_type")
    claim = registry().claim(model_type) if isinstance(model_type, str) else None
    if claim is None:
        return None
    return FamilyHooks(claim).arch_from_hf_config(hf_config)


def arch_from_gguf(architecture: str, metadata: dict[str, Any], tensor_names: list[str]) -> Arch | None:
    """Ask the plugin serving GGUF ``architecture`` to map its metadata (``None``: no plugin serves it)."""
    claim = registry().gguf_claim(architecture)
    if claim is None:
        return None
    return FamilyHooks(claim).arch_from_gguf(architecture, metadata, tensor_names)
