"""The epoch planner as it was before planning became linear (keye/data/sampler.py at commit 173c420), kept
as the reference that ``benchmarks/plan_epoch.py`` times and ``tests/data/test_plan_linear.py`` compares with.

It rescans the whole remaining queue twice per step (``sum(... for u in queue)``), so an epoch costs time
quadratic in its samples. The balancer it calls (keye/data/balance.py's ``lpt``, ``_improve``, ``balance`` and
``_ensure_min_items`` at the same commit) is copied in too, so the reference shares no planning code with
keye. Only this docstring and the imports differ from those files.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from keye.data.packing import split_into_bins
from keye.errors import KeyeConfigError


# ---------------------------------------------------------------- keye/data/balance.py at 173c420
def lpt(costs: Sequence[float], n_bins: int) -> list[list[int]]:
    """Sorted greedy: items by descending cost, each to the currently least-loaded bin.

    Returns ``n_bins`` lists of item indices (each list in assignment order). Ties: lower index first, then
    lower bin id.
    """
    if n_bins <= 0:
        raise KeyeConfigError(f"need at least one bin, got {n_bins}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap = [(0.0, b) for b in range(n_bins)]
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + costs[i], b))
    return bins


def _improve(bins: list[list[int]], costs: Sequence[float], max_rounds: int) -> list[list[int]]:
    """Pairwise local search: move or swap one item between the max-loaded bin and another bin whenever it
    lowers the larger of the two loads; stops when no such move exists (or after ``max_rounds``)."""
    loads = [sum(costs[i] for i in b) for b in bins]
    n = len(bins)
    for _ in range(max_rounds):
        hi = max(range(n), key=lambda b: (loads[b], -b))
        best: tuple[float, int, int, int] | None = None  # (new pair max, other bin, pos in hi, pos in other|-1)
        for lo in range(n):
            if lo == hi:
                continue
            pair_max = loads[hi]
            # Move one item hi -> lo.
            for a, i in enumerate(bins[hi]):
                new = max(loads[hi] - costs[i], loads[lo] + costs[i])
                if new < pair_max - 1e-12 and (best is None or new < best[0]):
                    best = (new, lo, a, -1)
            # Swap i (in hi) with j (in lo): the ideal j costs costs[i] - gap/2; look near it by bisection.
            lo_sorted = sorted((costs[j], c) for c, j in enumerate(bins[lo]))
            lo_costs = [x for x, _ in lo_sorted]
            half_gap = (loads[hi] - loads[lo]) / 2
            for a, i in enumerate(bins[hi]):
                k = bisect.bisect_left(lo_costs, costs[i] - half_gap)
                for kk in (k - 1, k):
                    if not 0 <= kk < len(lo_sorted):
                        continue
                    cj, c = lo_sorted[kk]
                    d = costs[i] - cj
                    if d <= 0:
                        continue
                    new = max(loads[hi] - d, loads[lo] + d)
                    if new < pair_max - 1e-12 and (best is None or new < best[0]):
                        best = (new, lo, a, c)
        if best is None:
            break
        _, lo, a, c = best
        i = bins[hi].pop(a)
        if c < 0:
            bins[lo].append(i)
            loads[hi] -= costs[i]
            loads[lo] += costs[i]
        else:
            j = bins[lo].pop(c)
            bins[lo].append(i)
            bins[hi].append(j)
            loads[hi] += costs[j] - costs[i]
            loads[lo] += costs[i] - costs[j]
    return bins


def balance(
    costs: Sequence[float],
    n_ranks: int,
    *,
    groups: Sequence[object] | None = None,
    min_per_rank: int = 1,
    refine: bool = True,
    max_rounds: int = 200,
) -> list[list[int]]:
    """Assign items to ranks so the most-loaded rank carries as little as possible.

    Args:
        costs: per-item cost (any non-negative unit, e.g. FLOPs).
        n_ranks: number of data-parallel ranks.
        groups: optional per-item group ids; items sharing an id always land on the same rank.
        min_per_rank: every rank gets at least this many items (so no rank runs an empty micro-batch);
            counted in items, groups are never split to satisfy it.
        refine: apply pairwise improvement after LPT.

    Returns:
        ``n_ranks`` lists of item indices, each sorted ascending. Every index appears exactly once.

    Raises:
        KeyeConfigError: fewer balancing units than ``n_ranks * min_per_rank`` allows, or negative costs.
    """
    if any(c < 0 for c in costs):
        raise KeyeConfigError("costs must be non-negative")
    n = len(costs)
    if groups is not None:
        if len(groups) != n:
            raise KeyeConfigError(f"groups has {len(groups)} entries for {n} costs")
        members: dict[object, list[int]] = {}
        for i, g in enumerate(groups):
            members.setdefault(g, []).append(i)
        units = list(members.values())
    else:
        units = [[i] for i in range(n)]
    if len(units) < n_ranks or n < n_ranks * min_per_rank:
        raise KeyeConfigError(
            f"cannot give {n_ranks} ranks at least {min_per_rank} item(s) each from {n} items in {len(units)} unit(s)"
        )
    ucost = [float(sum(costs[i] for i in u)) for u in units]
    bins = lpt(ucost, n_ranks)
    if refine:
        bins = _improve(bins, ucost, max_rounds)
    _ensure_min_items(bins, units, ucost, min_per_rank)
    out = [sorted(i for u in b for i in units[u]) for b in bins]
    return out


def _ensure_min_items(bins: list[list[int]], units: list[list[int]], ucost: list[float], k: int) -> None:
    """Move the cheapest units from item-rich ranks to ranks with fewer than ``k`` items (rare: happens only
    when a few huge items fill some ranks on their own)."""

    def count(b: int) -> int:
        return sum(len(units[u]) for u in bins[b])

    for _ in range(sum(len(u) for u in units)):
        poor = [b for b in range(len(bins)) if count(b) < k]
        if not poor:
            return
        p = poor[0]
        donors = [
            (ucost[u], b, u)
            for b in range(len(bins))
            if b != p
            for u in bins[b]
            if count(b) - len(units[u]) >= k
        ]
        if not donors:
            raise KeyeConfigError(f"cannot give every rank {k} item(s) without splitting a group")
        _, b, u = min(donors)
        bins[b].remove(u)
        bins[p].append(u)


# ---------------------------------------------------------------- keye/data/sampler.py at 173c420
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
