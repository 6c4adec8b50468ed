"""Coalescing: a list of tensors laid out in one flat buffer per dtype.

One collective over a flat buffer costs one launch and one rendezvous instead of one per
tensor; the buffers are allocated once per layout and reused every round, and
``allocations`` counts how many were ever made so tests can see the reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Slot:
    group: int
    offset: int
    numel: int
    shape: torch.Size


class FlatLayout:
    """Where each tensor of a fixed list lives inside its dtype's flat buffer."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.dtypes: list[torch.dtype] = []
        self.numels: list[int] = []
        slots: list[Slot] = []
        for t in tensors:
            if t.dtype not in self.dtypes:
                self.dtypes.append(t.dtype)
                self.numels.append(0)
            g = self.dtypes.index(t.dtype)
            slots.append(Slot(g, self.numels[g], t.numel(), t.shape))
            self.numels[g] += t.numel()
        self.slots: tuple[Slot, ...] = tuple(slots)

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        return sum(n * torch.empty((), dtype=d).element_size() for d, n in self.groups())

    def groups(self) -> list[tuple[torch.dtype, int]]:
        return list(zip(self.dtypes, self.numels))

    def views(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-tensor views into ``flats``, shaped and ordered like the original list."""
        return [flats[s.group].narrow(0, s.offset, s.numel).view(s.shape) for s in self.slots]


class FlatBuffers:
    """One flat buffer per dtype of a layout, with per-tensor views, allocated once."""

    allocations: int = 0  # class-wide: every flat buffer any instance ever allocated

    def __init__(self, layout: FlatLayout, device: torch.device, *, pin: bool = False) -> None:
        self.layout = layout
        self.device = device
        self.pinned = pin
        self.flats: list[torch.Tensor] = []
        for dtype, numel in layout.groups():
            self.flats.append(torch.empty(numel, dtype=dtype, device=device, pin_memory=pin))
            FlatBuffers.allocations += 1
        self.views: list[torch.Tensor] = layout.views(self.flats)

    def data_ptrs(self) -> tuple[int, ...]:
        return tuple(f.data_ptr() for f in self.flats)

    @torch.no_grad()
    def load_from(self, tensors: Sequence[torch.Tensor], *, non_blocking: bool = False) -> None:
        if len(tensors) != len(self.views):
            raise ValueError(f"expected {len(self.views)} tensors, got {len(tensors)}")
        if self.views:
            torch._foreach_copy_(self.views, [t.detach() for t in tensors], non_blocking)

    @torch.no_grad()
    def store_into(self, tensors: Sequence[torch.Tensor], *, non_blocking: bool = False) -> None:
        if len(tensors) != len(self.views):
            raise ValueError(f"expected {len(self.views)} tensors, got {len(tensors)}")
        if self.views:
            torch._foreach_copy_([t.detach() for t in tensors], self.views, non_blocking)
