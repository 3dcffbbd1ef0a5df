"""Context parallelism for long packed rows: one row split over the ranks of a context-parallel group.

Layout (:func:`context_parallel_layout`): the world of ``W`` ranks is ``W / N`` context-parallel groups of ``N``
*consecutive* ranks (group = rank // N, rank in group = rank % N). Every rank of a group holds the same
micro-batches; the groups are the data-parallel replicas, so a loader shards its samples over
``layout.num_groups`` replicas and ``layout.group`` is this rank's replica index. Gradients are averaged over the
whole world (DDP / FSDP2 on the default group, i.e. dp x cp flattened, as torchtitan shards), which is exact
because each rank's loss is its slice's summed token loss over the *global* target count.
"""

from __future__ import annotations

from dataclasses import dataclass

from keye.errors import KeyeConfigError


@dataclass(frozen=True)
class ContextParallelLayout:
    """Where one rank sits in the (data parallel x context parallel) layout.

    ``size``: ranks per context-parallel group (N, ``train.context_parallel``); ``rank`` / ``world_size``: the
    global rank and world. Groups are consecutive ranks: ranks ``[group * N, (group + 1) * N)``.
    """

    size: int = 1
    rank: int = 0
    world_size: int = 1

    @property
    def group(self) -> int:
        """This rank's context-parallel group, which is also its data-parallel replica index (rank // N)."""
        return self.rank // self.size

    @property
    def num_groups(self) -> int:
        """Number of context-parallel groups = data-parallel replicas (world / N)."""
        return self.world_size // self.size

    @property
    def rank_in_group(self) -> int:
        """This rank's place inside its group (rank % N): which slice of the row it computes."""
        return self.rank % self.size

    @property
    def group_ranks(self) -> list[int]:
        """The global ranks of this rank's group, in slice order."""
        return list(range(self.group * self.size, (self.group + 1) * self.size))

    @property
    def is_group_leader(self) -> bool:
        """True on the first rank of the group (the one that may read data and broadcast it to the others)."""
        return self.rank_in_group == 0

    def all_groups(self) -> list[list[int]]:
        """Every group's ranks, group by group (what ``torch.distributed.new_group`` is called with, on all ranks)."""
        return [list(range(g * self.size, (g + 1) * self.size)) for g in range(self.num_groups)]


def context_parallel_layout(world_size: int, rank: int, size: int) -> ContextParallelLayout:
    """The layout of ``world_size`` ranks in context-parallel groups of ``size`` consecutive ranks.

    Raises:
        KeyeConfigError: ``size`` < 1, or ``world_size`` not a multiple of ``size`` (the message names
            ``train.context_parallel``).
    """
    if size < 1:
        raise KeyeConfigError(f"train.context_parallel must be >= 1, got {size}")
    if world_size % size:
        raise KeyeConfigError(f"train.context_parallel={size} does not divide the world size {world_size}: every "
                              f"context-parallel group is {size} consecutive ranks")
    if not 0 <= rank < world_size:
        raise KeyeConfigError(f"rank {rank} is outside a world of {world_size}")
    return ContextParallelLayout(size=size, rank=rank, world_size=world_size)


__all__ = ["ContextParallelLayout", "context_parallel_layout"]
