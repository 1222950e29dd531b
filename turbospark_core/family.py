"""Everything a family plugin imports from turbospark, in one place.

A plugin writes ``from turbospark_core.family import ...`` and nothing else
from the core. The names, by what they are for:

Registration and hooks
    ``hookimpl`` (the ``@hookimpl`` marker), ``FamilySpec`` (what
    ``register_families`` registers), ``FamilyContext`` (what
    ``build_family_state`` receives), ``FamilyModel`` (the protocol its
    answer follows); ``HeadContext`` and ``DraftHead``, the same for
    ``build_mtp_head`` (a multi-token-prediction head).
Cache layout
    ``CacheSpec`` (a layer's full or sliding-window KV cache) and
    ``StateSpec`` (a layer's fixed-size recurrent state); a family builds
    them in ``Args.cache_layout()``.
Weights
    ``WeightStore`` (``context.weights``) and the objects it hands out:
    ``Linear``, ``Embedding``, ``ExpertBank``, and ``Experts`` (the protocol
    that resident and streamed expert banks both follow); ``fuse_linears``
    (one multiply for projections of the same input) and ``fused_parts``.
Attention
    ``Cache`` (any per-layer cache), ``AttentionCache`` (the protocol the
    two KV caches follow, for an attention layer's argument), ``KVCache``,
    ``RingKVCache``, ``RecurrentState``, ``causal_mask``; ``Rope`` and ``ROPE_TYPES``;
    ``attention`` (scaled dot-product attention, native for a CPU decode step;
    ``merge_heads=True`` for the ``[B, L, H * D]`` the output projection reads);
    ``cached_attention`` (the step's keys and values added to a cache and the
    queries attending to it under its mask: one native op for a float full cache);
    ``rope_heads`` (q, k, v heads from the fused q/k/v product, per-head norms,
    RoPE: one native op on the CPU); ``fused_layer`` (a pre-norm decoder
    layer's whole step, attention and gated MLP, as one native op:
    ``FusedLayer``, or ``None`` where its matrices are not held natively).
Fast ops
    ``rms_norm`` (``mx.fast.rms_norm``), ``silu_mul`` (the SwiGLU
    activation ``silu(gate) * up``) and ``gelu_tanh_mul`` (GeGLU,
    ``nn.gelu_approx(gate) * up``; either also of a fused gate/up product,
    ``silu_mul(gate_up)``): one native op each on the CPU, MLX's own
    elsewhere. Call them instead of ``mx.fast.rms_norm`` and hand-written
    activations. ``linear_normed`` (``proj(rms_norm(x, weight, eps))``),
    ``linear_gated`` (``residual + proj(act(gate) * up)``) and
    ``linear_plus`` (``residual + proj(x)``; both with an optional
    ``post_norm``, a sandwich norm before the add) fold the input's norm or
    gated activation, the output's norm and the residual add into a
    quantized product.
Conversion
    The records ``TensorTarget`` (where a source tensor goes),
    ``SourceTensor`` and ``AffineQuantized`` (an MLX-quantized matrix), and
    the Hugging Face conventions of :mod:`turbospark_core.convert.conventions`:
    ``text_config``, ``tied_embeddings``, ``is_tied_head``,
    ``strip_language_model_prefix``, ``drop_pattern`` (with
    ``VISION_TOWERS`` and ``MTP_HEADS``), ``rope_theta``, ``rope_scaling``;
    ``ResidualMap`` and ``NormReaders`` (the ``hadamard_residual_map``
    answer: which tensors read and write the residual stream) and
    ``names_under`` (the install names under a prefix with given suffixes).
Arch checks
    Typed, bounded checks for ``Args.problems``: ``int_problem``,
    ``float_problem`` (and ``int_problems``/``float_problems`` over a
    ``{key: bound}`` mapping),
    ``bool_problem``, ``index_list_problem``, ``keys_problem``,
    ``choice_list_problem``, ``section_problem``, ``rope_scaling_problems``,
    ``is_int``, ``is_number`` and the bounds ``MAX_LAYERS``, ``MAX_HEADS``,
    ``MAX_HEAD_DIM``, ``MAX_HIDDEN``, ``MAX_VOCAB``,
    ``MAX_INTERMEDIATE``, ``MAX_POSITIONS``, ``MAX_EXPERTS``, ``MAX_FLOAT``
    (the core checks the generic keys before asking the family).
Distributed (``open(distributed="tensor"|"pipeline")`` under ``mlx.launch``)
    ``DistributedPlan`` (the ``distributed_plan`` hook's answer), ``TensorPlan``
    with ``Split`` (which tensors split along which axis, per-rank head
    counts) and ``PipelinePlan`` (where a decoder layer's tensors live); see
    :mod:`turbospark_core.distributed.plan`.
Steering
    ``steer`` (call it on each decoder layer's output in the layer loop:
    ``h = steer(block(h, ...), i)``; it applies the active steering edit and
    residual capture, and returns ``h`` untouched when none is active).
Vision (see :mod:`turbospark_core.vision.tower` for the whole image flow)
    ``VisionSpec`` (``vision_arch_from_hf_config``'s answer), ``VisionContext``
    (what ``build_vision`` receives), ``VisionTower`` (the protocol its
    answer follows), ``PreparedImage`` (one preprocessed image),
    ``ImageFeatures`` (what the tower's ``encode`` returns), ``VisionInputs``
    (the ``vision=`` keyword of the trunk's forward), ``resize_rgb`` (PIL
    resampling of a decoded image, as the Hugging Face processors do),
    ``ImageError`` (an image the tower cannot take: a 400 in the server).
Errors
    ``TurbosparkError`` (the root), ``ArchConfigError`` (an arch config the
    flow cannot run), ``ConversionError`` (a source the converter cannot
    install), ``InstallError`` (an install missing what the flow needs).
"""

from __future__ import annotations

from turbospark_core import hookimpl
from turbospark_core.arch_check import (
    MAX_EXPERTS,
    MAX_FLOAT,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    bool_problem,
    choice_list_problem,
    float_problem,
    float_problems,
    index_list_problem,
    int_problem,
    int_problems,
    is_int,
    is_number,
    keys_problem,
    rope_scaling_problems,
    section_problem,
)
from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.context import DraftHead, FamilyContext, FamilyModel, HeadContext
from turbospark_core.convert.conventions import (
    MTP_HEADS,
    VISION_TOWERS,
    drop_pattern,
    is_tied_head,
    rope_scaling,
    rope_theta,
    strip_language_model_prefix,
    text_config,
    tied_embeddings,
)
from turbospark_core.convert.records import AffineQuantized, SourceTensor, TensorTarget
from turbospark_core.distributed.plan import DistributedPlan, PipelinePlan, Split, TensorPlan
from turbospark_core.errors import ArchConfigError, ConversionError, InstallError, TurbosparkError
from turbospark_core.hadamard import NormReaders, ResidualMap, names_under
from turbospark_core.kv_cache import AttentionCache, Cache, KVCache, RecurrentState, RingKVCache, causal_mask
from turbospark_core.layers import (
    Embedding,
    ExpertBank,
    Experts,
    FusedLayer,
    Linear,
    attention,
    cached_attention,
    fuse_linears,
    fused_layer,
    fused_parts,
    gelu_tanh_mul,
    linear_gated,
    linear_normed,
    linear_plus,
    rms_norm,
    rope_heads,
    silu_mul,
)
from turbospark_core.registry import FamilySpec
from turbospark_core.rope import ROPE_TYPES, Rope
from turbospark_core.steering import steer
from turbospark_core.vision.images import ImageError, resize_rgb
from turbospark_core.vision.tower import (
    ImageFeatures,
    PreparedImage,
    VisionContext,
    VisionInputs,
    VisionSpec,
    VisionTower,
)
from turbospark_core.weights import WeightStore

__all__ = [
    "MAX_EXPERTS",
    "MAX_FLOAT",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_HIDDEN",
    "MAX_INTERMEDIATE",
    "MAX_LAYERS",
    "MAX_POSITIONS",
    "MAX_VOCAB",
    "MTP_HEADS",
    "ROPE_TYPES",
    "VISION_TOWERS",
    "AffineQuantized",
    "ArchConfigError",
    "AttentionCache",
    "Cache",
    "CacheSpec",
    "ConversionError",
    "DistributedPlan",
    "DraftHead",
    "Embedding",
    "ExpertBank",
    "Experts",
    "FamilyContext",
    "FamilyModel",
    "FamilySpec",
    "FusedLayer",
    "HeadContext",
    "ImageError",
    "ImageFeatures",
    "InstallError",
    "KVCache",
    "Linear",
    "NormReaders",
    "PipelinePlan",
    "PreparedImage",
    "RecurrentState",
    "ResidualMap",
    "RingKVCache",
    "Rope",
    "SourceTensor",
    "Split",
    "StateSpec",
    "TensorPlan",
    "TensorTarget",
    "TurbosparkError",
    "VisionContext",
    "VisionInputs",
    "VisionSpec",
    "VisionTower",
    "WeightStore",
    "attention",
    "bool_problem",
    "cached_attention",
    "causal_mask",
    "choice_list_problem",
    "drop_pattern",
    "float_problem",
    "float_problems",
    "fuse_linears",
    "fused_layer",
    "fused_parts",
    "gelu_tanh_mul",
    "hookimpl",
    "index_list_problem",
    "int_problem",
    "int_problems",
    "is_int",
    "is_number",
    "is_tied_head",
    "keys_problem",
    "linear_gated",
    "linear_normed",
    "linear_plus",
    "names_under",
    "resize_rgb",
    "rms_norm",
    "rope_heads",
    "rope_scaling",
    "rope_scaling_problems",
    "rope_theta",
    "section_problem",
    "silu_mul",
    "steer",
    "strip_language_model_prefix",
    "text_config",
    "tied_embeddings",
]
