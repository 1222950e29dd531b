"""Tensor and pipeline parallelism over ``mx.distributed`` (processes started by ``mlx.launch``).

``turbospark_core.open(path, distributed="tensor"|"pipeline")`` in each
process of a group splits the model as the family's ``distributed_plan``
declares (:mod:`.plan`); everything that splits lives here, in the core's
objects, so a family flow has no sharding code. See ``docs/distributed.md``.
"""

from __future__ import annotations

from turbospark_core.distributed.group import MODES, Group, world
from turbospark_core.distributed.plan import DistributedPlan, PipelinePlan, Split, TensorPlan

__all__ = ["MODES", "DistributedPlan", "Group", "PipelinePlan", "Split", "TensorPlan", "world"]
