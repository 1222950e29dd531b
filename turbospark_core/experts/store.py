"""``experts.bin`` opened for one install: the resident or streamed bank of each routed layer, and their stats.

At open the store either reads every expert (``resident``) or keeps
``expert_slots`` experts per routed layer in memory and loads misses with
positional reads (``streamed``, :class:`StreamedExpertBank`).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np

from turbospark_core.compute import ComputePolicy
from turbospark_core.errors import ExpertBankTakenError, InstallError
from turbospark_core.experts.held import empty_slots, from_records, held_form, linear_of
from turbospark_core.experts.layout import ExpertLayout, LayerLayout
from turbospark_core.experts.plan import RESIDENT, STREAMED, ExpertPlan
from turbospark_core.experts.streamed import StreamedExpertBank
from turbospark_core.layers import ExpertBank, Experts
from turbospark_core.stats import ExpertStats

_READ_CHUNK = 64 << 20


class ExpertStore:
    """``experts.bin`` opened for one install: resident arrays or streamed banks, and their stats."""

    def __init__(self, path: Path, layout: ExpertLayout, plan: ExpertPlan, policy: ComputePolicy) -> None:
        self.path, self.layout, self.plan, self.policy = path, layout, plan, policy
        self._fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)
        self._resident: dict[str, dict[str, dict[str, mx.array]]] = {}  # prefix -> projection -> leaf -> [E, ...]
        self._slots: dict[str, dict[str, dict[str, mx.array]]] = {}  # prefix -> projection -> leaf -> [slots, ...]
        self._banks: dict[str, Experts] = {}
        self._pending: list[mx.array] = []
        self.counters = Counters(first=next(iter(layout.layers)))
        self.staging = np.empty(0, np.uint8)

    def setup(self) -> None:
        """Open step 10: read every expert (resident), or allocate the slots and the read buffer (streamed)."""
        for prefix, layer in self.layout.layers.items():
            if self.plan.residency == RESIDENT:
                records = self.read(layer.offset, layer.num_experts * layer.stride).reshape(
                    layer.num_experts, layer.stride
                )
                self._resident[prefix] = {name: from_records(p, records) for name, p in layer.projections.items()}
                mx.eval(self._resident[prefix])
            else:
                slots = min(self.plan.slots, layer.num_experts)
                self._slots[prefix] = {
                    name: empty_slots(p, slots, self.policy) for name, p in layer.projections.items()
                }
        if self.plan.residency == STREAMED:
            self.staging = np.empty(self.layout.staging_bytes(self.plan.slots), np.uint8)

    def read(self, offset: int, size: int, into: np.ndarray | None = None) -> np.ndarray:
        """``size`` bytes at ``offset`` with positional reads (bounded by the validated layout)."""
        buf = np.empty(size, np.uint8) if into is None else into[:size]
        view, done = buf.data, 0
        while done < size:
            got = os.preadv(self._fd, [view[done : done + _READ_CHUNK]], offset + done)
            if got <= 0:
                msg = (
                    f"{self.path}: read past its end at byte {offset + done}; "
                    "the file shrank after open, re-run `turbospark convert`"
                )
                raise InstallError(msg)
            done += got
        return buf

    def has(self, prefix: str) -> bool:
        """Whether ``prefix`` is a routed layer of experts.bin."""
        return prefix in self.layout.layers

    def bank(self, prefix: str, gate: str, up: str, down: str) -> Experts:
        """The bank of layer ``prefix`` with the family's projection names.

        Raises:
            ExpertBankTakenError: The layer's bank was already handed out (each is taken once).
            InstallError: The family's projection names or shapes do not match experts.bin.
        """
        if prefix in self._banks:
            msg = (
                f"the experts of layer {prefix!r} were already handed out: each routed layer's bank is taken "
                f"once from experts.bin; keep the bank the first WeightStore.experts({prefix!r}, ...) returned"
            )
            raise ExpertBankTakenError(msg)
        layer = self.layout.layers[prefix]
        _check_roles(layer, (gate, up, down))
        if self.plan.residency == STREAMED:
            bank: Experts = StreamedExpertBank(self, layer, (gate, up, down), self._slots.pop(prefix))
        else:
            raw = self._resident.pop(prefix)
            held = {name: held_form(layer.projections[name], raw[name], self.policy) for name in (gate, up, down)}
            self._pending.extend(a for h in held.values() for a in h.values())
            bank = ExpertBank(*(linear_of(layer.projections[n], held[n], self.plan.unpack) for n in (gate, up, down)))
        self._banks[prefix] = bank
        return bank

    def materialize(self) -> None:
        """Evaluate the resident experts' float32 form once (open step 11's end)."""
        if self._pending:
            mx.eval(self._pending)
            self._pending.clear()

    def unused(self) -> list[str]:
        """Routed layers the family never asked for."""
        return sorted(set(self.layout.layers) - set(self._banks))

    def stats(self) -> ExpertStats:
        """Counters since open."""
        return self.counters.snapshot(self.plan)


@attrs.define
class Counters:
    """The streamed banks' running counts; tokens are counted at the ``first`` routed layer only."""

    first: str
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    load_s: float = 0.0
    tokens: int = 0

    def snapshot(self, plan: ExpertPlan) -> ExpertStats:
        """The counts as a stats record."""
        return ExpertStats(
            residency=plan.residency,
            slots=plan.slots,
            hits=self.hits,
            misses=self.misses,
            bytes_read=self.bytes_read,
            load_ms=self.load_s * 1e3,
            tokens=self.tokens,
        )


def _check_roles(layer: LayerLayout, roles: tuple[str, str, str]) -> None:
    missing = [r for r in roles if r not in layer.projections]
    extra = sorted(set(layer.projections) - set(roles))
    if missing or extra:
        msg = (
            f"experts of {layer.prefix!r}: the family asks for projections {list(roles)}, experts.bin holds "
            f"{sorted(layer.projections)}; the install was made for another config, re-run `turbospark convert`"
        )
        raise InstallError(msg)
    gate, up, down = (layer.projections[r] for r in roles)
    if not (
        gate.out_features == up.out_features == down.in_features
        and gate.in_features == up.in_features == down.out_features
    ):
        msg = f"experts of {layer.prefix!r}: gate/up/down shapes do not chain; re-run `turbospark convert`"
        raise InstallError(msg)
