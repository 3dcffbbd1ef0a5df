"""The epoch plan: which samples each rank processes in each micro-batch of each global step.

Every rank builds the *same* plan from (seed, epoch, per-sample tokens and costs) and keeps its own part,
so no communication is needed and the plan is reproducible for resume. One epoch:

1. The balancing units (single samples, or whole RL groups when ``groups`` is given) are shuffled with
   ``numpy.random.default_rng([seed, epoch])``.
2. Units are cut into global steps: ``world_size * micro_batches * batch_size`` units per step
   (``batch_size`` mode) or as many units as fill ``fill * world_size * micro_batches * batch_tokens``
   tokens (``batch_tokens`` mode). A tail too small to give every rank ``micro_batches`` samples is merged
   into the last step.
3. Each step's samples go to ranks by cost (:func:`keye.data.balance.balance`: LPT + pairwise swaps).
4. Each rank's share is split into exactly ``micro_batches`` non-empty micro-batches (LPT on cost; in
   ``batch_tokens`` mode also a hard budget of ``batch_tokens`` tokens per micro-batch). A unit that fits no
   micro-batch is deferred to the front of the next step, so nothing is dropped; only the last step may
   overfill a micro-batch (``StepPlan.overfull``) when there is no later step to defer to.

Every sample of the epoch is in exactly one micro-batch of exactly one rank; every rank runs the same number
of micro-batches (``len(steps) * micro_batches``), which data-parallel training requires.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from keye.data.balance import balance
from keye.data.packing import split_into_bins
from keye.errors import KeyeConfigError


@dataclass
class StepPlan:
    """One global step: ``ranks[r][m]`` = sample indices of micro-batch ``m`` on rank ``r``."""

    ranks: list[list[list[int]]]
    overfull: bool = False


@dataclass
class EpochPlan:
    """All global steps of one epoch plus the samples excluded from it (longer than ``batch_tokens``)."""

    epoch: int
    steps: list[StepPlan]
    too_long: list[int] = field(default_factory=list)

    def rank_micro_batches(self, rank: int) -> list[list[int]]:
        """This rank's micro-batches in execution order (step-major)."""
        return [mb for s in self.steps for mb in s.ranks[rank]]


class BalancedSampler:
    """Deterministic, cost-balanced, exactly-once epoch planner for data-parallel training.

    Args:
        tokens: per-sample sequence length (exact token count), length N.
        costs: per-sample compute estimate (e.g. FLOPs), length N; balanced across ranks.
        world_size, rank: data-parallel layout (rank in [0, world_size)).
        batch_size: samples per rank per micro-batch on average (padded or packed training), or
        batch_tokens: token budget of one micro-batch (one packed row) - give exactly one of the two.
        micro_batches: micro-batches per rank per global step (gradient accumulation).
        groups: optional per-sample group ids kept together on one rank and in one step.
        exclude: sample indices to leave out (bad rows found before training).
        seed: shuffling seed; the plan of epoch e depends only on (seed, e) and the inputs.
        shuffle: shuffle units each epoch (False keeps manifest order, useful for evaluation).
        fill: in ``batch_tokens`` mode, target fraction of the step's total budget to fill before balancing.
        length_grouped: for padded training (``batch_size`` mode): split each rank's share into micro-batches
            of similar length (sorted by tokens, cut into equal-count runs) instead of by cost, so padding
            is small; the per-rank cost balance is unchanged.

    Raises:
        KeyeConfigError: inconsistent arguments or fewer samples than ``world_size * micro_batches``.
    """

    def __init__(
        self,
        tokens: Sequence[int],
        costs: Sequence[float],
        *,
        world_size: int = 1,
        rank: int = 0,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
        micro_batches: int = 1,
        groups: Sequence[object] | None = None,
        exclude: Sequence[int] = (),
        seed: int = 0,
        shuffle: bool = True,
        fill: float = 0.9,
        length_grouped: bool = False,
    ):
        if len(tokens) != len(costs):
            raise KeyeConfigError(f"tokens ({len(tokens)}) and costs ({len(costs)}) differ in length")
        if (batch_size is None) == (batch_tokens is None):
            raise KeyeConfigError("give exactly one of batch_size and batch_tokens")
        if world_size < 1 or not 0 <= rank < world_size:
            raise KeyeConfigError(f"rank {rank} is not in [0, world_size={world_size})")
        if micro_batches < 1 or (batch_size is not None and batch_size < 1):
            raise KeyeConfigError("micro_batches and batch_size must be >= 1")
        if batch_tokens is not None and batch_tokens < 1:
            raise KeyeConfigError("batch_tokens must be >= 1")
        if not 0.0 < fill <= 1.0:
            raise KeyeConfigError(f"fill must be in (0, 1], got {fill}")
        self.tokens = [int(t) for t in tokens]
        self.costs = [float(c) for c in costs]
        self.world_size, self.rank = world_size, rank
        self.batch_size, self.batch_tokens = batch_size, batch_tokens
        self.micro_batches = micro_batches
        self.seed, self.shuffle, self.fill = seed, shuffle, fill
        if length_grouped and batch_tokens is not None:
            raise KeyeConfigError("length_grouped applies to batch_size mode (padded training)")
        self.length_grouped = length_grouped
        excluded = set(int(i) for i in exclude)
        self.too_long = sorted(
            i for i, t in enumerate(self.tokens) if batch_tokens is not None and t > batch_tokens and i not in excluded
        )
        excluded |= set(self.too_long)
        units: dict[object, list[int]] = {}
        for i in range(len(self.tokens)):
            if i in excluded:
                continue
            key = ("g", groups[i]) if groups is not None and groups[i] is not None else ("s", i)
            units.setdefault(key, []).append(i)
        self.units = list(units.values())
        self.n_samples = sum(len(u) for u in self.units)
        if self.n_samples < world_size * micro_batches or len(self.units) < world_size:
            raise KeyeConfigError(
                f"{self.n_samples} usable samples in {len(self.units)} unit(s) cannot feed {world_size} rank(s) "
                f"x {micro_batches} micro-batch(es)"
            )
        self._cache: dict[int, EpochPlan] = {}

    # ------------------------------------------------------------------ planning
    def _unit_tokens(self, u: int) -> int:
        return sum(self.tokens[i] for i in self.units[u])

    def _take(self, queue: deque[int]) -> list[int]:
        min_units = self.world_size * self.micro_batches
        take: list[int] = []
        if self.batch_size is not None:
            want = self.world_size * self.micro_batches * self.batch_size
            n = 0
            while queue and (n < want or len(take) < self.world_size):
                take.append(queue.popleft())
                n += len(self.units[take[-1]])
        else:
            budget = self.fill * self.world_size * self.micro_batches * self.batch_tokens
            used = 0
            while queue and (len(take) < min_units or used + self._unit_tokens(queue[0]) <= budget):
                u = queue.popleft()
                take.append(u)
                used += self._unit_tokens(u)
        if sum(len(self.units[u]) for u in queue) < min_units or len(queue) < self.world_size:
            take.extend(queue)  # tail too small for a step of its own
            queue.clear()
        return take

    def _plan_step(self, take: list[int], queue: deque[int]) -> StepPlan:
        items = [i for u in take for i in self.units[u]]
        unit_of = {i: u for u in take for i in self.units[u]}
        groups = [unit_of[i] for i in items]
        per_rank = balance(
            [self.costs[i] for i in items], self.world_size, groups=groups, min_per_rank=self.micro_batches
        )
        ranks: list[list[list[int]]] = []
        over_items: list[list[int]] = []
        for share in per_rank:
            idx = [items[k] for k in share]
            if self.length_grouped:
                by_len = sorted(idx, key=lambda i: (self.tokens[i], i))
                ranks.append([sorted(c.tolist()) for c in np.array_split(np.asarray(by_len), self.micro_batches)])
                over_items.append([])
                continue
            bins, over = split_into_bins(
                [self.costs[i] for i in idx],
                self.micro_batches,
                sizes=[self.tokens[i] for i in idx],
                capacity=self.batch_tokens,
            )
            ranks.append([[idx[k] for k in b] for b in bins])
            over_items.append([idx[k] for k in over])
        deferred = {unit_of[i] for over in over_items for i in over}
        # Deferring a unit must not empty a micro-batch (lock-step training needs every one non-empty), and
        # the rest of the epoch must still be able to feed every rank; otherwise the unit stays and overfills.
        changed = True
        while changed and deferred:
            changed = False
            for mbs in ranks:
                for mb in mbs:
                    if mb and all(unit_of[i] in deferred for i in mb):
                        deferred -= {unit_of[i] for i in mb}
                        changed = True
        rest = sum(len(self.units[u]) for u in queue) + sum(len(self.units[u]) for u in deferred)
        if deferred and (rest < self.world_size * self.micro_batches or len(queue) + len(deferred) < self.world_size):
            deferred = set()
        overfull = False
        for r, mbs in enumerate(ranks):
            for mb in mbs:
                mb[:] = [i for i in mb if unit_of[i] not in deferred]
            for i in over_items[r]:
                if unit_of[i] in deferred:
                    continue
                overfull = True
                light = min(range(self.micro_batches), key=lambda m: (sum(self.tokens[j] for j in mbs[m]), m))
                mbs[light].append(i)
            for mb in mbs:
                mb.sort()
        for u in sorted(deferred, key=take.index, reverse=True):
            queue.appendleft(u)
        return StepPlan(ranks, overfull)

    def plan(self, epoch: int) -> EpochPlan:
        """The full (all-rank) plan of ``epoch``; cached."""
        if epoch in self._cache:
            return self._cache[epoch]
        order = np.arange(len(self.units))
        if self.shuffle:
            order = np.random.default_rng([int(self.seed), int(epoch)]).permutation(len(self.units))
        queue: deque[int] = deque(int(u) for u in order)
        steps: list[StepPlan] = []
        while queue:
            take = self._take(queue)
            steps.append(self._plan_step(take, queue))
        plan = EpochPlan(epoch, steps, list(self.too_long))
        self._cache = {epoch: plan}  # keep only the current epoch
        return plan

    def micro_batches_for(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of ``epoch`` in order (each a list of sample indices)."""
        return self.plan(epoch).rank_micro_batches(self.rank)

    def __len__(self) -> int:
        """Micro-batches per epoch for this rank (epoch 0; other epochs may differ in ``batch_tokens`` mode)."""
        return len(self.micro_batches_for(0))
