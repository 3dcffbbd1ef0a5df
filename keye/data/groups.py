"""Data-parallel groups of ranks for the training loader: who plans, who reads, who receives.

Layout (the one ``train.context_parallel`` uses): the ``world`` processes form ``world / group_size`` groups of
``group_size`` *consecutive* ranks; process ``rank`` is in group ``rank // group_size``. A group is one
data-parallel consumer: the epoch planner balances samples over the groups, and every rank of a group yields
the same micro-batches. Within a group only the first rank (``rank % group_size == 0``, the *reader*) reads,
decodes and collates, in its data-loader worker processes; it sends each collated micro-batch to the other
ranks of its group over a gloo process group (CPU tensors, whatever the training backend), so no rank of the
group decodes what another already did.

The epoch plan is made once: global rank 0 plans and broadcasts it (:meth:`DataGroups.share`), instead of
every rank planning the same epoch. Without an initialised ``torch.distributed`` whose world matches (simulated
ranks in tests, tools), every rank plans and reads for itself, which gives the same batches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from keye.errors import KeyeConfigError


@dataclass
class DataGroups:
    """The process layout of one loader (see the module docstring).

    Attributes:
        world, rank: processes and this process's rank.
        group_size: ranks per data-parallel group (1: every rank is its own group).
        connected: collectives are used (a matching ``torch.distributed`` world exists and was set up).
    """

    world: int
    rank: int
    group_size: int = 1
    connected: bool = False
    _group: Any = field(default=None, repr=False)
    _all: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.world % self.group_size:
            raise KeyeConfigError(f"group_size={self.group_size} does not divide the {self.world} ranks into groups")
        if not 0 <= self.rank < self.world:
            raise KeyeConfigError(f"rank {self.rank} is not in [0, world_size={self.world})")

    @property
    def num_groups(self) -> int:
        """Data-parallel consumers: the planner's world size."""
        return self.world // self.group_size

    @property
    def group(self) -> int:
        """This rank's group: the planner's rank."""
        return self.rank // self.group_size

    @property
    def reader(self) -> int:
        """Global rank of the process that reads and decodes this group's micro-batches."""
        return self.group * self.group_size

    @property
    def is_reader(self) -> bool:
        """This process reads and decodes (always, unless it receives from its group's reader)."""
        return not (self.connected and self.group_size > 1) or self.rank == self.reader

    def connect(self) -> DataGroups:
        """Create the gloo process groups when ``torch.distributed`` is initialised with ``world`` processes
        (collective: every rank calls it once, in the same order as its other collectives)."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == self.world > 1):
            return self
        gloo = dist.get_backend() == "gloo"
        self._all = None if gloo else dist.new_group(backend="gloo")
        if self.group_size > 1:
            for g in range(self.num_groups):  # every rank creates every group, in the same order
                ranks = list(range(g * self.group_size, (g + 1) * self.group_size))
                pg = dist.new_group(ranks, backend="gloo")
                if g == self.group:
                    self._group = pg
        self.connected = True
        return self

    def share(self, make: Callable[[], Any]) -> Any:
        """``make()`` on global rank 0, its result broadcast to every rank (pickled; collective)."""
        if not self.connected:
            return make()
        box = [make() if self.rank == 0 else None]
        torch.distributed.broadcast_object_list(box, src=0, group=self._all)
        return box[0]

    def broadcast_batch(self, batch: dict[str, Any] | None) -> dict[str, Any]:
        """The reader's collated micro-batch on every rank of the group (the reader passes it, the others
        ``None``): tensors are sent as tensors, everything else pickled."""
        if not (self.connected and self.group_size > 1):
            assert batch is not None
            return batch
        dist = torch.distributed
        if self.rank == self.reader:
            assert batch is not None
            tensors = {k: v.contiguous() for k, v in batch.items() if torch.is_tensor(v)}
            head: list[Any] = [({k: (t.shape, t.dtype) for k, t in tensors.items()},
                                {k: v for k, v in batch.items() if not torch.is_tensor(v)}, list(batch))]
        else:
            head = [None]
        dist.broadcast_object_list(head, src=self.reader, group=self._group)
        shapes, rest, order = head[0]
        out = dict(rest)
        for k in sorted(shapes):
            t = tensors[k] if self.rank == self.reader else torch.empty(shapes[k][0], dtype=shapes[k][1])
            dist.broadcast(t, src=self.reader, group=self._group)
            out[k] = t
        return {k: out[k] for k in order}  # the reader's key order
