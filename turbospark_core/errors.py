"""The one error hierarchy of turbospark: every refusal derives from TurbosparkError."""

from __future__ import annotations


class TurbosparkError(Exception):
    """Root of every error turbospark raises on purpose."""


class InstallError(TurbosparkError, ValueError):
    """The install on disk is missing, corrupt, or lies about itself."""


class NotAnInstallError(InstallError):
    """The path is something else (a checkpoint, a vision sidecar) passed as an install."""


class ManifestError(InstallError):
    """manifest.json is unreadable, malformed or inconsistent."""


class FileTableError(InstallError):
    """A file disagrees with the manifest's file table (size, presence, name)."""


class TensorStorageError(InstallError):
    """A tensor's storage (dtype, quantization) has no kernel here."""


class ArchConfigError(TurbosparkError, ValueError):
    """The architecture config is invalid or describes something unsupported."""


class OptionError(TurbosparkError, ValueError):
    """An open or generation option has a bad value."""


class MemoryBudgetError(TurbosparkError, MemoryError):
    """Opening would exceed the memory budget."""


class ContextOverflowError(TurbosparkError, ValueError):
    """A request would grow the context past max_context."""


class PluginError(TurbosparkError, RuntimeError):
    """A plugin failed to load, or two plugins conflict."""


class UnknownFamilyError(TurbosparkError, LookupError):
    """No installed plugin serves the model type."""

    def __str__(self) -> str:  # LookupError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class FamilyRefusalError(TurbosparkError, ValueError):
    """A family plugin refused a feature (steering, hadamard, KV quantization...)."""


class ExpertBankTakenError(TurbosparkError, RuntimeError):
    """A family asked twice for one routed layer's expert bank (each is handed out once)."""


class ConversionError(TurbosparkError, ValueError):
    """The converter cannot make an install from the source."""


class TokenizerError(TurbosparkError, ValueError):
    """The tokenizer files are missing or unusable, or a chat template failed."""


def refuse_unknown(given: object, known: set[str], what: str) -> None:
    """Raise :class:`OptionError` naming every key of ``given`` not in ``known``."""
    unknown = sorted(set(given) - known)  # type: ignore[call-overload]
    if unknown:
        msg = f"unknown {what} option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        raise OptionError(msg)


class DistributedError(TurbosparkError, ValueError):
    """A distributed open cannot split this model or these options over the group (naming the numbers and the fix)."""


class DrafterError(TurbosparkError, ValueError):
    """A speculative drafter cannot be opened for this install (hadamard folding, vocabulary, missing head)."""
