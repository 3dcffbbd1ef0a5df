"""Dynamic load balancing of one global batch across data-parallel ranks (Keye-VL §5).

Keye-VL estimates each sample's compute, sorts the global batch by cost (descending) and greedily gives each
sample to the rank with the lowest accumulated load (LPT, "longest processing time first"). We do that and
then improve it with pairwise moves/swaps between the most-loaded rank and every other rank, which removes
most of LPT's remaining imbalance when a few huge items (long videos) dominate. RL groups (samples sharing a
group id) can be kept on one rank: the group is then the unit that is balanced.

Everything is deterministic: ties are broken by item index and rank id, never by hashing or time.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from keye.errors import KeyeConfigError


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


def imbalance(costs: Sequence[float], assignment: Sequence[Sequence[int]]) -> float:
    """max / mean of the per-rank total cost (1.0 = perfect balance)."""
    loads = [sum(costs[i] for i in b) for b in assignment]
    mean = sum(loads) / len(loads)
    return max(loads) / mean if mean > 0 else 1.0
