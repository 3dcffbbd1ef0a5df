"""Packing samples into rows up to a token budget, and length bucketing for padded training.

Samples are never split: a sample longer than the budget is an error the caller reports (the sampler marks
it as a bad sample). All functions are pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

from keye.errors import KeyeConfigError


def pack_ffd(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing bin packing: indices grouped into rows whose lengths sum to <= ``budget``.

    Returns rows (lists of indices, each in ascending index order), ordered by their first index.

    Raises:
        KeyeConfigError: ``budget`` <= 0 or a single length exceeds ``budget``.
    """
    if budget <= 0:
        raise KeyeConfigError(f"token budget must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] > budget:
            raise KeyeConfigError(f"sample {i} has {lengths[i]} tokens, more than the row budget {budget}")
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(budget - lengths[i])
    rows = [sorted(r) for r in rows]
    rows.sort(key=lambda r: r[0])
    return rows


def split_into_bins(
    weights: Sequence[float], n_bins: int, *, sizes: Sequence[int] | None = None, capacity: int | None = None
) -> tuple[list[list[int]], list[int]]:
    """Split items into exactly ``n_bins`` non-empty bins with balanced ``weights`` (greedy LPT), optionally
    with a hard per-bin ``capacity`` on the sum of ``sizes``.

    Items are placed in descending weight order into the lightest bin where they fit; the first ``n_bins``
    items open one bin each, so no bin is empty when there are at least ``n_bins`` items.

    Returns:
        (bins, overflow): bins as lists of item indices (ascending); ``overflow`` lists items that fit in no
        bin under ``capacity`` (empty when ``capacity`` is ``None``).

    Raises:
        KeyeConfigError: fewer items than bins.
    """
    if len(weights) < n_bins:
        raise KeyeConfigError(f"cannot fill {n_bins} bins from {len(weights)} items")
    if n_bins == 1 and (capacity is None or sizes is None or sum(sizes) <= capacity):
        return [list(range(len(weights)))], []  # everything fits the one bin
    sizes = sizes if sizes is not None else [0] * len(weights)
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    load = [0.0] * n_bins
    used = [0] * n_bins
    overflow: list[int] = []
    for i in order:
        cands = [b for b in range(n_bins) if capacity is None or used[b] + sizes[i] <= capacity]
        if not cands:
            overflow.append(i)
            continue
        b = min(cands, key=lambda b: (len(bins[b]) > 0, load[b], b))
        bins[b].append(i)
        load[b] += weights[i]
        used[b] += sizes[i]
    return [sorted(b) for b in bins], sorted(overflow)


def length_buckets(
    lengths: Sequence[int],
    *,
    batch_size: int | None = None,
    batch_tokens: int | None = None,
    bucket_width: int = 256,
) -> list[list[int]]:
    """Group indices of similar length into padded batches.

    Items are sorted by (length // bucket_width, index) and cut into batches of ``batch_size`` items, or of
    as many items as keep ``len(batch) * max_length <= batch_tokens`` (the padded tensor size); a batch never
    mixes buckets. A stable sort
    keeps the order within a bucket, so a pre-shuffled index order stays shuffled inside buckets.

    Returns:
        Batches (lists of indices), in ascending-length order; the caller shuffles batch order.

    Raises:
        KeyeConfigError: neither or both of ``batch_size``/``batch_tokens`` given, or an item longer than
            ``batch_tokens``.
    """
    if (batch_size is None) == (batch_tokens is None):
        raise KeyeConfigError("give exactly one of batch_size and batch_tokens")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i] // bucket_width)
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    cur_bucket = None
    for i in order:
        bucket = lengths[i] // bucket_width
        if batch_tokens is not None and lengths[i] > batch_tokens:
            raise KeyeConfigError(f"sample {i} has {lengths[i]} tokens, more than batch_tokens {batch_tokens}")
        new_max = max(cur_max, lengths[i])
        full = (
            len(cur) == batch_size
            if batch_size is not None
            else (len(cur) + 1) * new_max > batch_tokens  # type: ignore[operator]
        )
        if cur and (full or bucket != cur_bucket):
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max, cur_bucket = new_max, bucket
    if cur:
        batches.append(cur)
    return batches
