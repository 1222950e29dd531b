"""The plugin manager: lazy entry-point loading and a typed facade over the hooks."""

from __future__ import annotations

import importlib.metadata
import os
import threading
from typing import Any

import pluggy

from turbospark_core import hookspecs
from turbospark_core.errors import PluginError, UnknownFamilyError
from turbospark_core.names import NAME
from turbospark_core.registry import FamilyRegistry, FamilySpec

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


def _import_entry_point(ep: importlib.metadata.EntryPoint) -> Any:
    try:
        return ep.load()
    except Exception as e:  # noqa: BLE001 - re-raised with the entry point named
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

    Built anew on each call (cheap), so plugins registered or unregistered
    since (tests, allow-list changes) are always reflected.
    """
    load_plugins()
    reg = FamilyRegistry()
    for impl in pm.hook.register_families.get_hookimpls():
        name = pm.get_name(impl.plugin) or repr(impl.plugin)
        impl.function(register=lambda spec, _n=name, _p=impl.plugin: reg.add(spec, _n, _p))
    return reg


class FamilyHooks:
    """Typed facade over the hooks of the one plugin that serves a model type."""

    def __init__(self, plugin: Any, spec: FamilySpec) -> None:
        self.spec = spec
        others = [p for p in pm.get_plugins() if p is not plugin]
        self._pm_subset = lambda name: pm.subset_hook_caller(name, remove_plugins=others)

    def _call(self, hook: str, /, **kwargs: Any) -> Any:
        return self._pm_subset(hook)(**kwargs)

    def arch_problems(self, arch: dict[str, Any]) -> list[str]:
        """The family's own problems with ``arch`` (empty when valid)."""
        return list(self._call("arch_problems", arch=arch) or [])

    def kv_quant_unsupported_reason(self, arch: dict[str, Any], kv_quant: str) -> str | None:
        """Why quantized KV is refused, or ``None``."""
        return self._call("kv_quant_unsupported_reason", arch=arch, kv_quant=kv_quant)

    def accepts_hadamard(self, arch: dict[str, Any]) -> bool:
        """Whether a hadamard-folded install can be served (default: no)."""
        return bool(self._call("accepts_hadamard", arch=arch))

    def steering_supported(self, arch: dict[str, Any]) -> bool:
        """Whether steering can be applied (default: no)."""
        return bool(self._call("steering_supported", arch=arch))

    def cache_layout(self, arch: dict[str, Any]) -> Any:
        """The per-layer cache specs."""
        return self._call("cache_layout", arch=arch)

    def build_family_state(self, context: Any) -> Any:
        """The family's model object."""
        return self._call("build_family_state", context=context)

    def hf_tensor_target(self, arch: dict[str, Any], name: str) -> Any:
        """Where a Hugging Face tensor goes."""
        return self._call("hf_tensor_target", arch=arch, name=name)

    def hf_tensor_transform(self, arch: dict[str, Any], name: str, data: Any) -> dict[str, Any] | None:
        """Install tensors rewritten from one Hugging Face tensor, or ``None``."""
        return self._call("hf_tensor_transform", arch=arch, name=name, data=data)

    def default_chat_template(self, arch: dict[str, Any]) -> str | None:
        """The family's chat template for installs without one."""
        return self._call("default_chat_template", arch=arch)

    def gguf_tensor_target(self, arch: dict[str, Any], name: str) -> Any:
        """Where a GGUF tensor goes."""
        return self._call("gguf_tensor_target", arch=arch, name=name)


def family_hooks(model_type: str, *, distribution: str | None = None) -> FamilyHooks:
    """The hooks of the plugin serving ``model_type``.

    Raises:
        UnknownFamilyError: No installed plugin serves it; the message names the
            installed families and the distribution to install.
    """
    reg = registry()
    if not reg.serves(model_type):
        raise UnknownFamilyError(reg.refusal(model_type, distribution))
    return FamilyHooks(reg.plugin_for(model_type), reg.spec_for(model_type))


def arch_from_hf_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """Ask every plugin to map a Hugging Face config (first answer wins)."""
    load_plugins()
    return pm.hook.arch_from_hf_config(hf_config=hf_config)


def arch_from_gguf(architecture: str, metadata: dict[str, Any], tensor_names: list[str]) -> dict[str, Any] | None:
    """Ask every plugin to map GGUF metadata (first answer wins)."""
    load_plugins()
    return pm.hook.arch_from_gguf(architecture=architecture, metadata=metadata, tensor_names=tensor_names)
