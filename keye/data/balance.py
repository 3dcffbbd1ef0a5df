"""Dynamic load balancing of one global batch across data-parallel ranks (Keye-VL §5).

Keye-VL estimates each sample's compute, sorts the global batch by cost (descending) and greedily gives each
sample to the rank with the lowest accumulated load (LPT, "longest processing time first"). We do that and
then improve it with pairwise moves/swaps between the most-loaded rank and every other rank, which removes
most of LPT's remaining imbalance when a few huge items (long videos) dominate. RL groups (samples sharing a
group id) can be kept on one rank: the group is then the unit that is balanced.

Everything is deterministic: ties are broken by item index and rank id, never by hashing or time.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

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


_NEIGHBOURS = np.array([-1, 0])


def _rows(n: int) -> np.ndarray:
    return np.arange(n)[:, None, None]


def _improve(bins: list[list[int]], costs: Sequence[float], max_rounds: int) -> list[list[int]]:
    """Pairwise local search: move or swap one item between the max-loaded bin and another bin whenever it
    lowers the larger of the two loads; stops when no such move exists (or after ``max_rounds``).

    Each round looks at these candidates, in this order, and applies the first one with the lowest new pair
    maximum: for every other bin ``lo`` (ascending), moving each item of the max-loaded bin ``hi`` (in list
    order), then swapping each item ``i`` of ``hi`` with the two items of ``lo`` whose costs bracket the ideal
    ``cost[i] - gap/2`` (``lo`` sorted by cost, then position). One round is evaluated for all candidates at
    once with numpy (the same float operations as one at a time, so the same choice).
    """
    n = len(bins)
    if n < 2:
        return bins
    c_arr = np.asarray(costs, dtype=np.float64)
    loads = [float(sum(costs[i] for i in b)) for b in bins]
    grid = np.full((n, max(len(costs), 1)), np.inf)  # grid[b, p]: cost of the item at position p of bins[b]
    lens = np.zeros(n, np.int64)

    def fill(b: int) -> None:
        grid[b, : lens[b] + 1] = np.inf  # a bin grows by one item at most per round
        grid[b, : len(bins[b])] = c_arr[bins[b]]
        lens[b] = len(bins[b])

    for b in range(n):
        fill(b)
    for _ in range(max_rounds):
        hi = max(range(n), key=lambda b: (loads[b], -b))
        h = len(bins[hi])
        if not h:
            break
        w = int(lens.max())
        view = grid[:, :w]
        h_cost = view[hi, :h]
        lo_load = np.asarray(loads)
        l_hi = loads[hi]
        moves = np.maximum(l_hi - h_cost, lo_load[:, None] + h_cost)  # [lo, a]
        sorted_cost = np.sort(view, axis=1)  # lo_sorted's costs (pads: inf, at the end)
        target = h_cost - ((l_hi - lo_load) / 2)[:, None]
        k = (sorted_cost[:, None, :] < target[:, :, None]).sum(-1)  # bisect_left, [lo, a]
        kk = k[:, :, None] + _NEIGHBOURS  # [lo, a, 2]: the items just below and at the ideal cost
        d = h_cost[None, :, None] - sorted_cost[_rows(n), np.clip(kk, 0, w - 1)]
        ok = (kk >= 0) & (kk < lens[:, None, None]) & (d > 0)
        swaps = np.where(ok, np.maximum(l_hi - d, lo_load[:, None, None] + d), np.inf)
        cand = np.concatenate([moves, swaps.reshape(n, -1)], axis=1)
        cand[hi] = np.inf
        cand[~(cand < l_hi - 1e-12)] = np.inf
        flat = int(np.argmin(cand))  # the first of the lowest, as the one-at-a-time scan keeps it
        if not np.isfinite(cand.flat[flat]):
            break
        lo, col = divmod(flat, cand.shape[1])
        if col < h:
            a, c = col, -1
        else:
            a, which = divmod(col - h, 2)
            # Position in bins[lo] of the kk-th item of lo sorted by (cost, position).
            c = int(np.argsort(view[lo, : lens[lo]], kind="stable")[kk[lo, a, which]])
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
        fill(hi)
        fill(lo)
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
    ucost = [float(sum(costs[i] for i in u)) for u in units]
    bins = balance_units(ucost, [len(u) for u in units], n_ranks, min_per_rank=min_per_rank, refine=refine,
                         max_rounds=max_rounds)
    return [sorted(i for u in b for i in units[u]) for b in bins]


def balance_units(
    ucost: Sequence[float],
    usize: Sequence[int],
    n_ranks: int,
    *,
    min_per_rank: int = 1,
    refine: bool = True,
    max_rounds: int = 200,
) -> list[list[int]]:
    """:func:`balance` on units already formed: unit ``u`` costs ``ucost[u]`` and holds ``usize[u]`` items.

    Returns ``n_ranks`` lists of unit indices (in assignment order). The epoch planner calls this directly
    with its units (no per-item group ids to regroup); :func:`balance` is this plus the grouping.

    Raises:
        KeyeConfigError: fewer units than ``n_ranks``, or fewer items than ``n_ranks * min_per_rank``.
    """
    n = sum(usize)
    if len(ucost) < n_ranks or n < n_ranks * min_per_rank:
        raise KeyeConfigError(
            f"cannot give {n_ranks} ranks at least {min_per_rank} item(s) each from {n} items in {len(ucost)} unit(s)"
        )
    ucost = list(ucost)
    bins = lpt(ucost, n_ranks)
    if refine:
        bins = _improve(bins, ucost, max_rounds)
    _ensure_min_items(bins, usize, ucost, min_per_rank)
    return bins


def _ensure_min_items(bins: list[list[int]], usize: Sequence[int], ucost: list[float], k: int) -> None:
    """Move the cheapest units from item-rich ranks to ranks with fewer than ``k`` items (rare: happens only
    when a few huge items fill some ranks on their own)."""

    def count(b: int) -> int:
        return sum(usize[u] for u in bins[b])

    if k <= 1 and all(bins):
        return  # every rank holds a unit of >= 1 item
    for _ in range(sum(usize)):
        poor = [b for b in range(len(bins)) if count(b) < k]
        if not poor:
            return
        p = poor[0]
        donors = [
            (ucost[u], b, u)
            for b in range(len(bins))
            if b != p
            for u in bins[b]
            if count(b) - usize[u] >= k
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
