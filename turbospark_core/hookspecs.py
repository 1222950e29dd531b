"""Hook specifications that turbospark_core fires while converting and opening a model.

A family plugin is a module registered under the ``turbospark`` entry-point
group (``[project.entry-points.turbospark]``) whose functions carry
``@turbospark_core.hookimpl``. Every hook but ``register_families`` receives
the arch config (a plain dict with at least ``model_type``) or the source
config it is made from.

The core calls every hook but ``register_families`` only on the one plugin
that serves the family (its ``FamilySpec`` claims the model type, or the GGUF
architecture for ``arch_from_gguf``), through a pluggy subset caller; see
:class:`turbospark_core.plugins.FamilyHooks`. An implementation therefore never
checks the model type; ``None`` from a hook means "no answer" (each hook says
what the core does then), never "not mine".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

from turbospark_core.names import NAME

if TYPE_CHECKING:
    from turbospark_core.cache_spec import CacheSpec, StateSpec
    from turbospark_core.context import DraftHead, FamilyContext, FamilyModel, HeadContext
    from turbospark_core.convert.records import TensorTarget
    from turbospark_core.distributed.plan import DistributedPlan
    from turbospark_core.hadamard import ResidualMap
    from turbospark_core.registry import FamilySpec
    from turbospark_core.vision.tower import VisionContext, VisionSpec, VisionTower

hookspec = pluggy.HookspecMarker(NAME)

Arch = dict[str, Any]

# ----------------------------------------------------------- registration


@hookspec
def register_families(register: Callable[[FamilySpec], None]) -> None:
    """Declare the families this plugin serves.

    Fires when the core builds its family registry: every plugin's
    implementation is called (not firstresult), one plugin at a time, each
    with a ``register`` that records the caller as the family's plugin. The
    return value is ignored, so return ``None``. Call
    ``register(FamilySpec(...))`` once per family; two plugins claiming one
    model type (or GGUF architecture) is an error naming both.

    Args:
        register: Callback taking a :class:`~turbospark_core.registry.FamilySpec`.
    """


# ------------------------------------------------------------ conversion


@hookspec(firstresult=True)
def arch_from_hf_config(hf_config: dict[str, Any]) -> Arch | None:
    """Map a Hugging Face ``config.json`` onto the install's arch config.

    Fires during ``turbospark convert`` of a Hugging Face or mlx-lm directory,
    on the plugin whose ``FamilySpec.model_types`` has ``hf_config["model_type"]``.
    Return ``None`` if this config cannot be mapped (the core then refuses
    the conversion naming the model type). Stops at first non-None result.
    The returned dict must keep ``model_type``.

    Args:
        hf_config: The parsed ``config.json``.
    """


@hookspec(firstresult=True)
def arch_from_gguf(architecture: str, metadata: dict[str, Any], tensor_names: list[str]) -> Arch | None:
    """Map GGUF metadata onto the install's arch config.

    Fires during ``turbospark convert`` of a GGUF file, on the plugin whose
    ``FamilySpec.gguf_architectures`` has ``architecture``. Return ``None`` if
    this file cannot be mapped (the core then refuses the conversion naming
    the architecture). Stops at first non-None result.

    Args:
        architecture: The GGUF ``general.architecture`` value.
        metadata: Every GGUF key/value as plain Python values.
        tensor_names: The file's tensor names (e.g. to tell a tied head:
            no ``output.weight``).
    """


@hookspec(firstresult=True)
def hf_tensor_target(arch: Arch, name: str) -> TensorTarget | None:
    """Say where a Hugging Face tensor goes in the install.

    Fires once per source tensor during conversion from a Hugging Face or
    mlx-lm directory. Return ``TensorTarget.drop()`` for a tensor to ignore
    (a vision tower), or the install name (and expert index for per-expert
    tensors to stack); ``None`` leaves it unmapped, which the converter
    refuses naming the tensor. Stops at first non-None result.

    Args:
        arch: The arch config from :func:`arch_from_hf_config`.
        name: The tensor's Hugging Face name.
    """


@hookspec(firstresult=True)
def hf_tensor_transform(arch: Arch, name: str, data: Any) -> dict[str, Any] | None:
    """Rewrite one Hugging Face tensor into install tensors (split, transpose, de-interleave).

    Fires once per source tensor during conversion from a Hugging Face or
    mlx-lm directory, before :func:`hf_tensor_target`. Return ``None`` to let
    :func:`hf_tensor_target` place the tensor as it is; otherwise a dict of install name -> array (an
    ``mx.array``/numpy array, or a :class:`~turbospark_core.convert.records.AffineQuantized`
    matrix, e.g. an MXFP4 expert block). Stops at first non-None result.

    Args:
        arch: The arch config from :func:`arch_from_hf_config`.
        name: The tensor's Hugging Face name.
        data: The tensor (lazy ``mx.array``) or an ``AffineQuantized`` matrix.
    """


@hookspec(firstresult=True)
def gguf_tensor_target(arch: Arch, name: str) -> TensorTarget | None:
    """Say where a GGUF tensor goes in the install (and how its rows are laid out).

    Fires once per tensor during conversion from a GGUF file. ``None`` leaves
    it unmapped, which the converter refuses naming the tensor. Stops at
    first non-None result.

    Args:
        arch: The arch config from :func:`arch_from_gguf`.
        name: The GGUF tensor name (``blk.0.attn_q.weight``).
    """


# ------------------------------------------------------------ open: probes


@hookspec(firstresult=True)
def arch_problems(arch: Arch) -> list[str] | None:
    """Check an arch config with the family's own rules.

    Fires at open (step 3), after the core's generic checks. Return the list
    of problems (empty when valid), each naming the key and what the flow
    supports; ``None`` counts as no problems. Stops at first non-None result.

    Args:
        arch: The install's arch config.
    """


@hookspec(firstresult=True)
def kv_quant_unsupported_reason(arch: Arch, kv_quant: str) -> str | None:
    """Say why this family cannot use quantized KV ``kv_quant``.

    Fires at open (step 4) when ``kv_quant`` is requested. Return ``None`` when
    it is supported; otherwise the reason. Stops at first non-None result.

    Args:
        arch: The install's arch config.
        kv_quant: The requested KV quantization (``"q8"``, ``"q4"``).
    """


@hookspec(firstresult=True)
def accepts_hadamard(arch: Arch) -> bool | None:
    """Whether the family can serve a hadamard-folded install.

    Asked once at open (before step 6); the answer is kept in the capability
    record, refuses a hadamard-folded install at step 6 when false, and is
    shown by ``turbospark inspect``. ``None`` counts as no. Stops at first
    non-None result.

    Args:
        arch: The install's arch config.
    """


@hookspec(firstresult=True)
def hadamard_residual_map(arch: Arch, names: list[str]) -> ResidualMap | None:
    """Say which install tensors read and write the residual stream, for ``convert --rotate``.

    Fires at conversion, after the tensors are mapped (pre-quantized ones
    dequantized), in families whose ``accepts_hadamard`` says yes. The core
    folds a randomized Hadamard rotation with the answer (see
    :mod:`turbospark_core.hadamard`): each norm's scale into its readers, the
    embedding and head, the readers' input side, the writers' output side.
    The family's flow must then compute exactly what it did (rotation is
    invisible to it: norms become ones, a tied head comes untied). ``None``
    refuses the rotation. Stops at first non-None result.

    Args:
        arch: The install's arch config.
        names: Every install tensor name (float, before cast and quantize).
    """


@hookspec(firstresult=True)
def steering_supported(arch: Arch) -> str | None:
    """Why the family's flow cannot apply steering directions, or ``None`` when it can.

    Asked once at open (the answer is kept in the capability record, shown by
    ``inspect`` and the server's ``/v1/models``); open step 14 and every
    steered request or residual capture are refused with the reason. Return
    ``None`` only when the flow passes each decoder layer's output through
    ``turbospark_core.family.steer(h, layer)`` (the core also refuses a
    steered forward that never reached a steered layer). A plugin that does
    not implement the hook is refused steering. Stops at first non-None
    result.

    Args:
        arch: The install's arch config.
    """


@hookspec(firstresult=True)
def distributed_plan(arch: Arch) -> DistributedPlan | None:
    """Declare how the family's model splits across the ranks of ``mlx.launch`` (``open(distributed=...)``).

    Asked at open, only when ``distributed`` is given and the group has more
    than one process. A declaration, not sharding code (see
    :mod:`turbospark_core.distributed.plan`): for tensor parallelism, which
    tensors split along which axis in units of which heads and which arch keys
    count heads per rank; for pipeline parallelism, where decoder layer
    ``i``'s tensors live and what its block returns. The core reads only each
    rank's share, builds the family's flow from the per-rank arch, and does
    the collectives inside its linear, embedding and expert objects. Give
    ``tensor_refusal`` / ``pipeline_refusal`` for an arch the flow cannot
    split (the open is refused with it). ``None`` (or a plugin without the
    hook): both modes are refused naming the family. Stops at first non-None
    result.

    Args:
        arch: The install's arch config.
    """


@hookspec(firstresult=True)
def cache_layout(arch: Arch) -> list[CacheSpec | StateSpec] | None:
    """Describe the caches the family needs: full or sliding KV, recurrent state.

    Fires at open before memory estimation and cache allocation. The core
    makes one cache object per entry, in order, for every sequence (the flow
    indexes them; a KV-sharing layer may reuse an earlier entry). ``None``
    means no caches at all. Stops at first non-None result.

    Args:
        arch: The install's arch config.
    """


@hookspec(firstresult=True)
def default_chat_template(arch: Arch) -> str | None:
    """A chat template (Jinja) for installs that carry none.

    Fires when the tokenizer is loaded and ``tokenizer_config.json`` has no
    ``chat_template``. Return ``None`` if the family has no default (chat is
    then refused naming the missing template). Stops at first non-None result.

    Args:
        arch: The install's arch config.
    """


# ------------------------------------------------------------ open: build


@hookspec(firstresult=True)
def build_family_state(context: FamilyContext) -> FamilyModel | None:
    """Build the layer graph for the family that owns ``context.arch``.

    Fires at open (step 11), after weights are mapped and caches planned.
    ``None`` is refused at open as an incomplete plugin. Stops at first
    non-None result.

    Args:
        context: Arch config, the core's weight store (linear, embedding,
            norm and expert objects) and the cache layout.
    """


# ------------------------------------------------------------ vision sidecar


@hookspec(firstresult=True)
def vision_arch_from_hf_config(hf_config: dict[str, Any]) -> VisionSpec | None:
    """Describe the checkpoint's vision tower for a sidecar (``turbospark convert --vision``).

    Fires during conversion of a Hugging Face directory when a sidecar is
    asked for. Return ``None`` when the family has no vision flow for this
    config (the core refuses the sidecar naming the model type); otherwise a
    :class:`~turbospark_core.vision.tower.VisionSpec` (the tower's arch, the
    placeholder token ids, the width of its embeddings). Stops at first
    non-None result.

    Args:
        hf_config: The parsed ``config.json`` (with its ``vision_config``).
    """


@hookspec(firstresult=True)
def vision_tensor_target(vision: dict[str, Any], name: str) -> TensorTarget | None:
    """Say where a Hugging Face tensor goes in the vision sidecar.

    Fires once per source tensor when a sidecar is written. Return
    ``TensorTarget.drop()`` for every tensor that is not the tower's (the
    text decoder, audio towers), the sidecar name otherwise. ``None`` is
    refused naming the tensor. Stops at first non-None result.

    Args:
        vision: The ``vision`` of :func:`vision_arch_from_hf_config`'s answer.
        name: The tensor's Hugging Face name.
    """


@hookspec(firstresult=True)
def build_vision(context: VisionContext) -> VisionTower | None:
    """Build the vision tower a sidecar describes, for the trunk ``context.arch``.

    Fires when a sidecar is attached (``open(path, vision=SIDECAR)``), after
    the core checked that the sidecar fits the trunk (family, hidden size,
    placeholder ids). Return a
    :class:`~turbospark_core.vision.tower.VisionTower` (the protocol and the
    whole image flow are documented in :mod:`turbospark_core.vision.tower`);
    the trunk model built by ``build_family_state`` must then accept
    ``model(inputs, cache, vision=VisionInputs)``. ``None``, or a plugin
    without the hook, is refused naming the family. Stops at first non-None
    result.

    Args:
        context: The trunk's arch, the sidecar's vision arch, processor
            config, placeholder ids and weights.
    """


# ------------------------------------------------------------ drafters


@hookspec(firstresult=True)
def build_mtp_head(context: HeadContext) -> DraftHead | None:
    """Build the install's multi-token-prediction head, for the ``mtp`` drafter.

    Fires only when an open asks for ``mtp`` and the install has a head
    (``mtp.safetensors``, manifest section ``mtp``), after
    ``build_family_state``; never otherwise, so nothing of the head is read
    or allocated by a plain open. ``context.weights`` holds the head's
    tensors; every one must be used (as for ``build_family_state``). Raise
    :class:`~turbospark_core.errors.ArchConfigError` for a head the flow cannot
    run, naming the key. A plugin that does not implement the hook has no
    head flow: ``mtp=DEPTH`` is refused naming it. Stops at first non-None
    result.

    Args:
        context: Arch config, the trunk model, the head's weight store.
    """
