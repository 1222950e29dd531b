"""Which plugin serves which model type: the family registry."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from turbospark_core.errors import PluginError


def _names(values: Iterable[str]) -> tuple[str, ...]:
    """The names a plugin gave (any iterable of strings), as a tuple."""
    return tuple(values)


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
    model_types: tuple[str, ...] = attrs.field(converter=_names)
    distribution: str
    gguf_architectures: tuple[str, ...] = attrs.field(converter=_names, default=())


@attrs.frozen(kw_only=True)
class Claim:
    """One plugin's claim on a model type or GGUF architecture."""

    spec: FamilySpec
    plugin_name: str
    plugin: object = attrs.field(eq=False)


@attrs.define
class FamilyRegistry:
    """Model type (and GGUF architecture) -> (family, plugin) claims, refusing double claims by name."""

    _claims: dict[str, Claim] = attrs.Factory(dict)
    _gguf: dict[str, Claim] = attrs.Factory(dict)

    def add(self, spec: FamilySpec, plugin_name: str, plugin: object) -> None:
        """Record ``spec`` as served by ``plugin``; a second claim is an error."""
        claim = Claim(spec=spec, plugin_name=plugin_name, plugin=plugin)
        for model_type in spec.model_types:
            _claim(self._claims, model_type, f"model type {model_type!r}", claim)
        for architecture in spec.gguf_architectures:
            _claim(self._gguf, architecture, f"GGUF architecture {architecture!r}", claim)

    def families(self) -> list[FamilySpec]:
        """Every registered family, once each, sorted by name."""
        seen = {id(c.spec): c.spec for c in self._claims.values()}
        return sorted(seen.values(), key=lambda s: s.name)

    def serves(self, model_type: str) -> bool:
        """Whether an installed plugin serves ``model_type``."""
        return model_type in self._claims

    def claim(self, model_type: str) -> Claim | None:
        """The claim on ``model_type``, if an installed plugin serves it."""
        return self._claims.get(model_type)

    def gguf_claim(self, architecture: str) -> Claim | None:
        """The claim on GGUF ``general.architecture`` value ``architecture``, if a plugin serves it."""
        return self._gguf.get(architecture)

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


def _claim(claims: dict[str, Claim], key: str, what: str, claim: Claim) -> None:
    other = claims.get(key)
    if other is not None and other.plugin is not claim.plugin:
        msg = (
            f"{what} is claimed by two plugins: "
            f"{other.plugin_name!r} (family {other.spec.name!r}) and "
            f"{claim.plugin_name!r} (family {claim.spec.name!r}); uninstall one of "
            f"{other.spec.distribution!r} / {claim.spec.distribution!r}"
        )
        raise PluginError(msg)
    claims[key] = claim
