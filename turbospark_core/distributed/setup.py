"""The distributed steps of the open sequence: refusals, this rank's share, its weight store and model.

:func:`prepare` runs after the tensor index and the experts section are read
(open steps 7 and 10's layout), before anything is mapped. Without
``distributed``, or in a group of one process (no ``mlx.launch``), it returns
``None`` and the open is exactly the single-process open.
"""

from __future__ import annotations

import abc
from typing import Any

import attrs
import mlx.core as mx

from turbospark_core.cache_spec import CacheSpec, StateSpec
from turbospark_core.compute import ComputePolicy
from turbospark_core.context import FamilyModel
from turbospark_core.distributed.group import Group, world
from turbospark_core.distributed.pipeline import Stage, StageModel, check_layers, install_relays, stage_layout
from turbospark_core.distributed.plan import DistributedPlan, PipelinePlan, TensorPlan
from turbospark_core.distributed.reader import ShardReader
from turbospark_core.distributed.share import StageShare, TensorShare, layer_costs
from turbospark_core.distributed.shares import layer_ranges, per_rank_arch
from turbospark_core.distributed.store import ShardedWeightStore, StageWeightStore
from turbospark_core.errors import DistributedError
from turbospark_core.experts.layout import ExpertLayout, LayerLayout
from turbospark_core.manifest import WEIGHTS, Manifest
from turbospark_core.options import OpenOptions
from turbospark_core.plugins import FamilyHooks
from turbospark_core.tensor_index import TensorIndex
from turbospark_core.weights import WeightStore

Layout = tuple[CacheSpec | StateSpec, ...]


@attrs.frozen(kw_only=True)
class DistributedInfo:
    """What ``inspect`` and the CLI say about a distributed open: the mode, this rank and its share."""

    mode: str
    rank: int
    size: int
    share: str
    held_bytes: int
    total_bytes: int

    def describe(self) -> str:
        """One line: mode, rank, share and the weight bytes this rank holds."""
        return (
            f"{self.mode} parallel, rank {self.rank} of {self.size}: {self.share}; holds "
            f"{self.held_bytes / 1e6:.2f} MB of the install's {self.total_bytes / 1e6:.2f} MB of weights"
        )


def refuse_options(options: OpenOptions) -> None:
    """Options that cannot work on a group of processes, each refused with the reason.

    Raises:
        DistributedError: Naming the option and what to do instead.
    """
    mode = options.distributed
    if options.router_histogram or options.ffn_histogram:
        name = "router_histogram" if options.router_histogram else "ffn_histogram"
        msg = (
            f"{name}=True with distributed={mode!r} is refused: each rank holds only its share of the layers "
            f"or experts, so its histogram would count only that share; record histograms on one process"
        )
        raise DistributedError(msg)
    if options.vision is not None:
        msg = (
            f"vision={str(options.vision)!r} with distributed={mode!r} is refused: the vision tower is not split "
            f"across ranks; attach the sidecar to a single-process open"
        )
        raise DistributedError(msg)
    drafters = options.drafters_named()
    if drafters and options.num_draft_tokens is None:
        msg = (
            f"{drafters[0]} with distributed={mode!r} needs num_draft_tokens=K: the adaptive draft length is "
            f"timed on each rank, and ranks that draft different counts would run different forwards; pass a "
            f"fixed num_draft_tokens (--num-draft-tokens)"
        )
        raise DistributedError(msg)


def mode_plan(plan: DistributedPlan | None, mode: str, hooks: FamilyHooks, model_type: str) -> Any:
    """The family's declaration for ``mode`` (a :class:`TensorPlan` or :class:`PipelinePlan`).

    Raises:
        DistributedError: The family declares none for this mode, with its reason when it gave one.
    """
    who = f"family {hooks.spec.name!r} ({hooks.spec.distribution})"
    if plan is None:
        msg = (
            f"{who} declares no distributed plan (the distributed_plan hook), so distributed={mode!r} cannot "
            f"split model type {model_type!r}; open it without distributed (one process)"
        )
        raise DistributedError(msg)
    chosen = plan.tensor if mode == "tensor" else plan.pipeline
    if chosen is not None:
        return chosen
    reason = plan.tensor_refusal if mode == "tensor" else plan.pipeline_refusal
    other = "pipeline" if mode == "tensor" else "tensor"
    available = plan.pipeline if mode == "tensor" else plan.tensor
    fix = f"use distributed={other!r}" if available is not None else "open it without distributed (one process)"
    why = reason or f"it declares no {mode}-parallel plan"
    raise DistributedError(f"{who} refuses distributed={mode!r} for model type {model_type!r}: {why}; {fix}")


class DistributedOpen(abc.ABC):
    """The distributed parts of one open (see :func:`prepare`); the loader calls them in order."""

    mode = ""

    def __init__(self, group: Group, manifest: Manifest, index: TensorIndex, experts: ExpertLayout | None) -> None:
        self.group, self.manifest, self.index, self.experts = group, manifest, index, experts
        self.reader = ShardReader(manifest.path(WEIGHTS), manifest.files[WEIGHTS].size)

    @property
    def arch(self) -> dict[str, Any]:
        """The arch config the family builds this rank's flow from."""
        return self.manifest.arch

    def held_layout(self, layout: Layout) -> Layout:
        """The caches this rank allocates (and the memory guard counts)."""
        return layout

    @abc.abstractmethod
    def held_index(self) -> TensorIndex:
        """The tensors (or slices) this rank reads."""

    @abc.abstractmethod
    def held_experts(self) -> ExpertLayout | None:
        """The experts.bin records this rank reads: a layout of only them."""

    @abc.abstractmethod
    def weights(self, policy: ComputePolicy) -> WeightStore:
        """This rank's weight store."""

    def finish(self, model: FamilyModel, family: str) -> FamilyModel:
        """The model the runner calls (after ``build_family_state``)."""
        return model

    def agree(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (a collective: every rank asks at the same point)."""
        return self.group.agree(flag)

    def seed(self) -> None:
        """Seed MLX's global generator alike on every rank (unseeded sampling then agrees)."""
        mx.random.seed(self.group.shared_seed())

    @abc.abstractmethod
    def share(self) -> str:
        """What this rank holds, in words."""

    def info(self) -> DistributedInfo:
        """The record ``inspect`` shows."""
        held = self.held_index().stored_bytes()
        total = self.index.stored_bytes()
        experts = self.held_experts()
        if self.experts is not None and experts is not None:
            held += sum(layer.num_experts * layer.stride for layer in experts.layers.values())
            total += sum(layer.num_experts * layer.stride for layer in self.experts.layers.values())
        return DistributedInfo(
            mode=self.mode,
            rank=self.group.rank,
            size=self.group.size,
            share=self.share(),
            held_bytes=held,
            total_bytes=total,
        )


class TensorOpen(DistributedOpen):
    """Tensor parallelism: every rank holds a slice of the declared tensors and of every routed layer's experts."""

    mode = "tensor"

    def __init__(
        self, group: Group, manifest: Manifest, index: TensorIndex, experts: ExpertLayout | None, plan: TensorPlan
    ) -> None:
        super().__init__(group, manifest, index, experts)
        self.plan = plan
        self._arch = per_rank_arch(manifest.arch, plan.per_rank, group.size)
        self.tensors = TensorShare(plan, index, group.size, group.rank)
        self._experts = None if experts is None else self._local_experts(experts)

    @property
    def arch(self) -> dict[str, Any]:
        """The arch config with each declared head count replaced by this rank's."""
        return self._arch

    def _local_experts(self, layout: ExpertLayout) -> ExpertLayout:
        layers = {}
        for prefix, layer in layout.layers.items():
            first, count = self.tensors.experts_share(layer.num_experts, prefix)
            layers[prefix] = attrs.evolve(layer, offset=layer.offset + first * layer.stride, num_experts=count)
        top_k = None if layout.top_k is None else min(layout.top_k, min(x.num_experts for x in layers.values()))
        return attrs.evolve(layout, layers=layers, top_k=top_k)

    def held_index(self) -> TensorIndex:
        """Every tensor's slice this rank reads."""
        return self.tensors.local_index()

    def held_experts(self) -> ExpertLayout | None:
        """Each routed layer's records of this rank's experts."""
        return self._experts

    def weights(self, policy: ComputePolicy) -> WeightStore:
        """A :class:`ShardedWeightStore` over this rank's slices."""
        path = self.manifest.path(WEIGHTS)
        return ShardedWeightStore(path, self.index, policy, self.tensors, self.reader, self.group.handle)

    def share(self) -> str:
        """Heads per rank, experts and vocabulary rows held."""
        arch = self.manifest.arch
        parts = [
            f"{key} {self._arch_value(self._arch, key)} of {self._arch_value(arch, key)}"
            for key in self.plan.per_rank
            if self._arch_value(arch, key) is not None
        ]
        if self.experts is not None:
            layer = next(iter(self.experts.layers.values()))
            first, count = self.tensors.experts_share(layer.num_experts, layer.prefix)
            parts.append(f"experts {first}-{first + count - 1} of {layer.num_experts} per routed layer")
        vocab = [(b, self.tensors.vocab_rows(b)) for b in self.plan.vocab]
        parts += [f"{b} rows {r[0]}-{r[1] - 1}" for b, r in vocab if r is not None]
        return "; ".join(parts) or "replicated"

    @staticmethod
    def _arch_value(arch: dict[str, Any], key: str) -> Any:
        node: Any = arch
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node


class StageOpen(DistributedOpen):
    """Pipeline parallelism: every rank holds a contiguous range of decoder layers (and the rest whole)."""

    mode = "pipeline"

    def __init__(
        self, group: Group, manifest: Manifest, index: TensorIndex, experts: ExpertLayout | None, plan: PipelinePlan
    ) -> None:
        super().__init__(group, manifest, index, experts)
        self.plan = plan
        self.num_layers = int(manifest.arch["num_hidden_layers"])
        expert_bytes = {} if experts is None else {p: x.num_experts * x.stride for p, x in experts.layers.items()}
        self.ranges = layer_ranges(layer_costs(index, plan, self.num_layers, expert_bytes), group.size, plan.tied)
        self.layers = self.ranges[group.rank]
        self.tensors = StageShare(plan, index, self.layers, self.num_layers)

    def _mine(self, prefix: str) -> bool:
        return self.tensors.holds(f"{prefix}.")

    def held_layout(self, layout: Layout) -> Layout:
        """Other ranks' cache entries hold nothing."""
        return stage_layout(layout, self.layers)

    def held_index(self) -> TensorIndex:
        """The tensors outside other ranks' layers."""
        return self.tensors.local_index()

    def held_experts(self) -> ExpertLayout | None:
        """The routed layers among this rank's layers (``None`` when it runs none)."""
        if self.experts is None:
            return None
        layers: dict[str, LayerLayout] = {p: x for p, x in self.experts.layers.items() if self._mine(p)}
        return attrs.evolve(self.experts, layers=layers) if layers else None

    def weights(self, policy: ComputePolicy) -> WeightStore:
        """A :class:`StageWeightStore`: whole tensors here, placeholders for other ranks' layers."""
        counts = {} if self.experts is None else {p: x.num_experts for p, x in self.experts.layers.items()}
        path = self.manifest.path(WEIGHTS)
        return StageWeightStore(path, self.index, policy, self.tensors, self.reader, counts)

    def finish(self, model: FamilyModel, family: str) -> FamilyModel:
        """Relays in place of other ranks' layers, and the hand-over at layer outputs."""
        check_layers(model, self.num_layers, family)
        install_relays(model, self.layers, self.plan, family)
        stage = Stage(self.group.handle, self.group.rank, self.group.size, self.layers, self.num_layers)
        remote = [i for i in range(self.num_layers) if not self.layers[0] <= i < self.layers[1]]
        return StageModel(model, stage, remote)

    def share(self) -> str:
        """The decoder layers this rank runs."""
        a, b = self.layers
        held = f"layers {a}-{b - 1}" if b - a > 1 else f"layer {a}"
        return f"decoder {held} of {self.num_layers}"


def prepare(
    manifest: Manifest,
    hooks: FamilyHooks,
    index: TensorIndex,
    experts: ExpertLayout | None,
    options: OpenOptions,
    group: Group | None = None,
) -> DistributedOpen | None:
    """The distributed open, or ``None``: no ``distributed`` option, or a group of one process.

    Raises:
        DistributedError: An option that cannot work distributed, a family without a plan for the
            mode, a hadamard-folded install under tensor parallelism, or a split the group cannot make
            (naming the numbers and the fix).
    """
    mode = options.distributed
    if mode is None:
        return None
    group = group or world()
    if group.size == 1:
        return None
    refuse_options(options)
    plan = mode_plan(hooks.distributed_plan(manifest.arch), mode, hooks, manifest.model_type)
    if mode == "pipeline":
        return StageOpen(group, manifest, index, experts, plan)
    if manifest.hadamard is not None:
        msg = (
            f"{manifest.root} is hadamard-folded: its online transforms rotate whole rows that tensor parallelism "
            f"splits across ranks; use distributed='pipeline', or an install converted without --rotate"
        )
        raise DistributedError(msg)
    return TensorOpen(group, manifest, index, experts, plan)
