"""Which plugin serves which model type: the family registry."""

from __future__ import annotations

from typing import Any

import attrs

from turbospark_core.errors import PluginError, UnknownFamilyError


@attrs.frozen(kw_only=True)
class FamilySpec:
    """A family a plugin declares in ``register_families``.

    Attributes:
        name: Family name (``"llama"``).
        model_types: Hugging Face ``model_type`` values served.
        distribution: The pip distribution that provides it.
        gguf_architectures: GGUF ``general.architecture`` values served.
    """

    name: str
    model_types: tuple[str, ...] = attrs.field(converter=tuple)
    distribution: str
    gguf_architectures: tuple[str, ...] = attrs.field(converter=tuple, default=())


@attrs.frozen(kw_only=True)
class _Claim:
    spec: FamilySpec
    plugin_name: str
    plugin: Any = attrs.field(eq=False)


@attrs.define
class FamilyRegistry:
    """Model type -> (family, plugin) claims, refusing double claims by name."""

    _claims: dict[str, _Claim] = attrs.Factory(dict)

    def add(self, spec: FamilySpec, plugin_name: str, plugin: Any) -> None:
        """Record ``spec`` as served by ``plugin``; a second claim is an error."""
        for model_type in spec.model_types:
            other = self._claims.get(model_type)
            if other is not None and other.plugin is not plugin:
                msg = (
                    f"model type {model_type!r} is claimed by two plugins: "
                    f"{other.plugin_name!r} (family {other.spec.name!r}) and "
                    f"{plugin_name!r} (family {spec.name!r}); uninstall one of "
                    f"{other.spec.distribution!r} / {spec.distribution!r}"
                )
                raise PluginError(msg)
            self._claims[model_type] = _Claim(spec=spec, plugin_name=plugin_name, plugin=plugin)

    def families(self) -> list[FamilySpec]:
        """Every registered family, once each, sorted by name."""
        seen = {id(c.spec): c.spec for c in self._claims.values()}
        return sorted(seen.values(), key=lambda s: s.name)

    def plugin_for(self, model_type: str) -> Any:
        """The plugin object serving ``model_type``."""
        return self._claim(model_type).plugin

    def spec_for(self, model_type: str) -> FamilySpec:
        """The family serving ``model_type``."""
        return self._claim(model_type).spec

    def serves(self, model_type: str) -> bool:
        """Whether an installed plugin serves ``model_type``."""
        return model_type in self._claims

    def _claim(self, model_type: str) -> _Claim:
        claim = self._claims.get(model_type)
        if claim is None:
            raise UnknownFamilyError(self.refusal(model_type)) from None
        return claim

    def refusal(self, model_type: str, distribution: str | None = None) -> str:
        """The message for a model type no installed plugin serves.

        Args:
            model_type: The unserved model type.
            distribution: The plugin distribution the install was made with,
                when the manifest records it.
        """
        installed = ", ".join(
            f"{s.name} ({', '.join(s.model_types)})" for s in self.families()
        ) or "none"
        fix = (
            f"install {distribution}"
            if distribution
            else "install the turbospark plugin distribution that serves it"
        )
        return (
            f"no installed plugin serves model type {model_type!r}; "
            f"installed families: {installed}; {fix}"
        )
