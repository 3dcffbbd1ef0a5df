"""The epoch plan: which samples each rank processes in each micro-batch of each global step.

The plan is a pure function of (seed, epoch, per-sample tokens and costs, layout), so it is reproducible for
resume; the loader plans once per epoch on rank 0 and broadcasts it (every rank could plan the same plan on
its own). One epoch:

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

Planning is linear in the number of samples: the units live in numpy arrays (no Python object per sample
outside the step being planned), the step cuts come from running sums (``searchsorted`` on cumulative token and
sample counts) and the counts of what is left are kept as running totals. The plan is the same, step for step,
as the earlier planner that rescanned the remaining queue every step (``benchmarks/plan_epoch.py`` compares
them). The finished plan is stored as flat arrays (:class:`EpochPlan`).

Elastic resume: :meth:`BalancedSampler.plan` takes ``done`` (samples of the epoch already trained, e.g. under
another number of ranks) and ``limit`` (only samples ``< limit`` take part, the rows the epoch started with
when the manifest grew since); the rest of the epoch is planned in the epoch's own shuffled order. When what
is left cannot give every rank ``micro_batches`` samples, the plan has one step in which some micro-batches
are empty (the loader runs an all-masked micro-batch there, as for a micro-batch whose samples all failed).
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from keye.data.balance import balance_units, lpt
from keye.data.packing import split_into_bins
from keye.errors import KeyeConfigError


@dataclass
class StepPlan:
    """One global step: ``ranks[r][m]`` = sample indices of micro-batch ``m`` on rank ``r``."""

    ranks: list[list[list[int]]]
    overfull: bool = False


@dataclass
class EpochPlan:
    """All global steps of one epoch, stored flat, plus the samples excluded from it (longer than
    ``batch_tokens``).

    Attributes:
        epoch: the epoch number.
        world_size, micro_batches: the layout the plan is for.
        samples: int64 sample indices, step-major, then rank, then micro-batch (each micro-batch ascending).
        bounds: int64 offsets into ``samples``, length ``n_steps * world_size * micro_batches + 1``: micro-batch
            ``m`` of rank ``r`` in step ``s`` is ``samples[bounds[k]:bounds[k + 1]]``, ``k = (s*W + r)*M + m``.
        overfull: bool per step (see :class:`StepPlan`).
        too_long: sample indices left out of every epoch for exceeding ``batch_tokens``.
    """

    epoch: int
    world_size: int
    micro_batches: int
    samples: np.ndarray
    bounds: np.ndarray
    overfull: np.ndarray
    too_long: list[int] = field(default_factory=list)

    @property
    def n_steps(self) -> int:
        """Global steps in the epoch."""
        return len(self.overfull)

    @property
    def steps(self) -> list[StepPlan]:
        """The steps as nested lists (built on each access; for inspection and tests)."""
        W, M = self.world_size, self.micro_batches
        b = self.bounds.tolist()
        flat = self.samples.tolist()
        return [
            StepPlan([[flat[b[(s * W + r) * M + m]: b[(s * W + r) * M + m + 1]] for m in range(M)] for r in range(W)],
                     bool(self.overfull[s]))
            for s in range(self.n_steps)
        ]

    def rank_micro_batches(self, rank: int) -> list[list[int]]:
        """This rank's micro-batches in execution order (step-major)."""
        W, M = self.world_size, self.micro_batches
        k = (np.arange(self.n_steps)[:, None] * W + rank) * M + np.arange(M)[None, :]
        starts, ends = self.bounds[k.ravel()].tolist(), self.bounds[k.ravel() + 1].tolist()
        flat = self.samples
        return [flat[a:b].tolist() for a, b in zip(starts, ends)]

    def consumed(self, position: int) -> np.ndarray:
        """The samples every rank has been handed once each rank ran its first ``position`` micro-batches
        (int64, ascending)."""
        W, M = self.world_size, self.micro_batches
        full, part = divmod(int(position), M)
        parts = [self.samples[: self.bounds[full * W * M]]]
        if part and full < self.n_steps:
            for r in range(W):
                k = (full * W + r) * M
                parts.append(self.samples[self.bounds[k]: self.bounds[k + part]])
        return np.sort(np.concatenate(parts))


def _cumsum0(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, np.int64)
    np.cumsum(x, out=out[1:])
    return out


class _Queue:
    """The units still to plan in one epoch: deferred units (``front``) before the untouched rest of the shuffled
    order (positions ``pos..n``), with the counts of what is left kept as running sums."""

    def __init__(self, ptr: np.ndarray, tokens: np.ndarray):
        self.size = np.diff(ptr)
        self.tok = tokens
        self.cum_size = _cumsum0(self.size)
        self.cum_tok = _cumsum0(tokens)
        self.front: deque[int] = deque()
        self.pos, self.n = 0, len(self.size)
        self.front_samples = 0

    def __bool__(self) -> bool:
        return bool(self.front) or self.pos < self.n

    def units_left(self) -> int:
        return len(self.front) + self.n - self.pos

    def samples_left(self) -> int:
        return self.front_samples + int(self.cum_size[self.n] - self.cum_size[self.pos])

    def pop_front(self) -> int:
        u = self.front.popleft()
        self.front_samples -= int(self.size[u])
        return u

    def push_front(self, u: int) -> None:
        self.front.appendleft(u)
        self.front_samples += int(self.size[u])

    def take_range(self, k: int) -> list[int]:
        k = max(0, min(k, self.n - self.pos))
        out = list(range(self.pos, self.pos + k))
        self.pos += k
        return out

    def take_all(self) -> list[int]:
        out = list(self.front) + list(range(self.pos, self.n))
        self.front.clear()
        self.front_samples = 0
        self.pos = self.n
        return out


class BalancedSampler:
    """Deterministic, cost-balanced, exactly-once epoch planner for data-parallel training.

    Args:
        tokens: per-sample sequence length (exact token count), length N.
        costs: per-sample compute estimate (e.g. FLOPs), length N; balanced across ranks.
        world_size, rank: data-parallel layout (rank in [0, world_size)); with context-parallel groups these
            count groups, not processes (see :func:`keye.data.loader.build_dataloader`'s ``group_size``).
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
        tokens: Sequence[int] | np.ndarray,
        costs: Sequence[float] | np.ndarray,
        *,
        world_size: int = 1,
        rank: int = 0,
        batch_size: int | None = None,
        batch_tokens: int | None = None,
        micro_batches: int = 1,
        groups: Sequence[object] | None = None,
        exclude: Sequence[int] | np.ndarray = (),
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
        if length_grouped and batch_tokens is not None:
            raise KeyeConfigError("length_grouped applies to batch_size mode (padded training)")
        self.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.costs = np.asarray(costs, dtype=np.float64).reshape(-1)
        if (self.costs < 0).any():
            raise KeyeConfigError("costs must be non-negative")
        self.world_size, self.rank = world_size, rank
        self.batch_size, self.batch_tokens = batch_size, batch_tokens
        self.micro_batches = micro_batches
        self.seed, self.shuffle, self.fill = seed, shuffle, fill
        self.length_grouped = length_grouped
        self.groups = groups
        n = len(self.tokens)
        if groups is not None and len(groups) != n:
            raise KeyeConfigError(f"groups has {len(groups)} entries for {n} samples")
        usable = np.ones(n, bool)
        ex = np.asarray(exclude, dtype=np.int64).reshape(-1)
        usable[ex[(ex >= 0) & (ex < n)]] = False
        long = self.tokens > batch_tokens if batch_tokens is not None else np.zeros(n, bool)
        self.too_long = np.flatnonzero(long & usable).tolist()
        self.usable = usable & ~long
        self._units: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        ptr, _ = self._unit_table(n)
        self.n_units = len(ptr) - 1
        self.n_samples = int(self.usable.sum())
        if self.n_samples < world_size * micro_batches or self.n_units < world_size:
            raise KeyeConfigError(
                f"{self.n_samples} usable samples in {self.n_units} unit(s) cannot feed {world_size} rank(s) "
                f"x {micro_batches} micro-batch(es)"
            )
        self._cache: dict[tuple, EpochPlan] = {}

    # ------------------------------------------------------------------ units
    def _unit_table(self, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Units of the samples ``< limit`` as CSR arrays (``members[ptr[u]:ptr[u+1]]``), in order of first
        appearance; cached per ``limit``."""
        if limit in self._units:
            return self._units[limit]
        idx = np.flatnonzero(self.usable[:limit])
        if self.groups is None:
            table = (np.arange(len(idx) + 1, dtype=np.int64), idx.astype(np.int64))
        else:
            units: dict[object, list[int]] = {}
            for i in idx.tolist():
                g = self.groups[i]
                units.setdefault(("g", g) if g is not None else ("s", i), []).append(i)
            lists = list(units.values())
            ptr = _cumsum0(np.fromiter((len(u) for u in lists), np.int64, len(lists)))
            members = np.fromiter((i for u in lists for i in u), np.int64, int(ptr[-1]))
            table = (ptr, members)
        self._units[limit] = table
        return table

    def _epoch_units(self, epoch: int, limit: int, done: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's units in shuffled order as CSR arrays, without the samples in ``done``."""
        ptr, members = self._unit_table(limit)
        n_units = len(ptr) - 1
        order = np.arange(n_units)
        if self.shuffle:
            order = np.random.default_rng([int(self.seed), int(epoch)]).permutation(n_units)
        size = np.diff(ptr)[order]
        new_ptr = _cumsum0(size)
        gather = np.repeat(ptr[:-1][order] - new_ptr[:-1], size) + np.arange(int(new_ptr[-1]))
        mem = members[gather]
        if done is not None and len(done):
            keep = ~np.isin(mem, done)
            unit_of = np.repeat(np.arange(n_units), size)
            kept = np.bincount(unit_of[keep], minlength=n_units)
            mem = mem[keep]
            new_ptr = _cumsum0(kept[kept > 0])
        return new_ptr, mem

    # ------------------------------------------------------------------ planning
    def _take(self, q: _Queue) -> list[int]:
        """Cut the next step's units off the queue (running sums instead of rescans)."""
        W, M = self.world_size, self.micro_batches
        min_units = W * M
        take: list[int] = []
        if self.batch_size is not None:
            want = W * M * self.batch_size
            n = 0
            while q.front and (n < want or len(take) < W):
                take.append(q.pop_front())
                n += int(q.size[take[-1]])
            if not q.front and (n < want or len(take) < W):
                # Smallest k with n + (samples of the next k units) >= want, and at least W units in all.
                k1 = int(np.searchsorted(q.cum_size, q.cum_size[q.pos] + want - n, side="left")) - q.pos
                take += q.take_range(max(k1 if n < want else 0, W - len(take)))
        else:
            budget = self.fill * W * M * self.batch_tokens
            # used + t <= budget for integers is used + t <= floor(budget): exact integer cuts below.
            budget_int = math.floor(budget)
            used = 0
            while q.front and (len(take) < min_units or used + int(q.tok[q.front[0]]) <= budget):
                u = q.pop_front()
                take.append(u)
                used += int(q.tok[u])
            if not q.front:
                first = q.take_range(min_units - len(take))
                take += first
                if first:
                    used += int(q.cum_tok[q.pos] - q.cum_tok[first[0]])
                # The next units while they fit: cumulative tokens are non-decreasing, so "take while the
                # next one fits" is the longest prefix whose running sum stays within the budget.
                end = int(np.searchsorted(q.cum_tok, budget_int - used + int(q.cum_tok[q.pos]), side="right")) - 1
                take += q.take_range(end - q.pos)
        if q.samples_left() < min_units or q.units_left() < W:
            take += q.take_all()  # tail too small for a step of its own
        return take

    def _unit_cost(self, mem: np.ndarray, ptr: np.ndarray, u: int) -> float:
        a, b = int(ptr[u]), int(ptr[u + 1])
        if b - a == 1:
            return float(self.costs[mem[a]])
        return float(sum(self.costs[mem[a:b]].tolist()))  # left-to-right, as the unit's members are listed

    def _plan_step(self, take: list[int], q: _Queue, ptr: np.ndarray, mem: np.ndarray) -> StepPlan:
        W, M = self.world_size, self.micro_batches
        tokens, costs = self.tokens, self.costs
        t = np.asarray(take, dtype=np.int64)
        if self.groups is None:  # one sample per unit
            first = mem[ptr[t]]
            members = [[i] for i in first.tolist()]
            ucost = self.costs[first].tolist()
            usize = [1] * len(take)
        else:
            members = [mem[ptr[u]: ptr[u + 1]].tolist() for u in take]
            ucost = [self._unit_cost(mem, ptr, u) for u in take]
            usize = [len(m) for m in members]
        per_rank = balance_units(ucost, usize, W, min_per_rank=M)
        unit_of: dict[int, int] = {}
        for u, m in zip(take, members):
            for i in m:
                unit_of[i] = u
        ranks: list[list[list[int]]] = []
        over_items: list[list[int]] = []
        for share in per_rank:
            idx = [i for k in sorted(share) for i in members[k]]  # item order: as taken
            if self.length_grouped:
                by_len = sorted(idx, key=lambda i: (tokens[i], i))
                ranks.append([sorted(c.tolist()) for c in np.array_split(np.asarray(by_len), M)])
                over_items.append([])
                continue
            bins, over = split_into_bins(
                costs[idx].tolist(), M, sizes=tokens[idx].tolist(), capacity=self.batch_tokens
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
        rest = q.samples_left() + sum(int(q.size[u]) for u in deferred)
        if deferred and (rest < W * M or q.units_left() + len(deferred) < W):
            deferred = set()
        overfull = False
        for r, mbs in enumerate(ranks):
            for mb in mbs:
                mb[:] = [i for i in mb if unit_of[i] not in deferred]
            for i in over_items[r]:
                if unit_of[i] in deferred:
                    continue
                overfull = True
                light = min(range(M), key=lambda m: (int(tokens[mbs[m]].sum()) if mbs[m] else 0, m))
                mbs[light].append(i)
            for mb in mbs:
                mb.sort()
        pos = {u: k for k, u in enumerate(take)}
        for u in sorted(deferred, key=pos.__getitem__, reverse=True):
            q.push_front(u)
        return StepPlan(ranks, overfull)

    def _sparse_step(self, take: list[int], ptr: np.ndarray, mem: np.ndarray) -> StepPlan:
        """The rest of a resumed epoch when it cannot give every rank ``micro_batches`` samples: one step, units
        to ranks by cost (LPT), each rank's samples one per micro-batch while they last (so some micro-batches
        are empty), a rank with more samples than micro-batches split by cost as usual."""
        W, M = self.world_size, self.micro_batches
        members = [mem[ptr[u]: ptr[u + 1]].tolist() for u in take]
        ucost = [float(sum(self.costs[m].tolist())) for m in members]
        ranks: list[list[list[int]]] = []
        overfull = False
        for share in lpt(ucost, W):
            idx = sorted(i for k in share for i in members[k])
            if len(idx) < M:
                ranks.append([[i] for i in idx] + [[] for _ in range(M - len(idx))])
                continue
            bins, over = split_into_bins(self.costs[idx].tolist(), M, sizes=self.tokens[idx].tolist(),
                                         capacity=self.batch_tokens)
            mbs = [[idx[k] for k in b] for b in bins]
            for k in over:
                overfull = True
                min(mbs, key=lambda mb: int(self.tokens[mb].sum())).append(idx[k])
            ranks.append([sorted(mb) for mb in mbs])
        return StepPlan(ranks, overfull)

    def plan(self, epoch: int, *, done: np.ndarray | Sequence[int] | None = None,
             limit: int | None = None) -> EpochPlan:
        """The full (all-rank) plan of ``epoch``; cached (the latest one).

        Args:
            epoch: the epoch.
            done: samples of this epoch already trained (a resumed epoch): left out, the rest planned in the
                epoch's shuffled order.
            limit: only samples ``< limit`` take part (the rows the epoch started with; default all).
        """
        limit = len(self.tokens) if limit is None else int(limit)
        done_arr = None if done is None else np.unique(np.asarray(done, dtype=np.int64))
        key = (int(epoch), limit, None if done_arr is None else hashlib.sha1(done_arr.tobytes()).hexdigest())
        if key in self._cache:
            return self._cache[key]
        ptr, mem = self._epoch_units(epoch, limit, done_arr)
        tok = np.add.reduceat(self.tokens[mem], ptr[:-1]) if len(mem) else np.zeros(0, np.int64)
        q = _Queue(ptr, tok)
        W, M = self.world_size, self.micro_batches
        flat = _FlatSteps()
        if q and (q.samples_left() < W * M or q.units_left() < W):
            flat.add(self._sparse_step(q.take_all(), ptr, mem))
        while q:
            flat.add(self._plan_step(self._take(q), q, ptr, mem))
        plan = flat.plan(epoch, W, M, self.too_long)
        self._cache = {key: plan}  # keep only the current epoch
        return plan

    def micro_batches_for(self, epoch: int, **kw: object) -> list[list[int]]:
        """This rank's micro-batches of ``epoch`` in order (each a list of sample indices); ``kw`` as in
        :meth:`plan`."""
        return self.plan(epoch, **kw).rank_micro_batches(self.rank)  # type: ignore[arg-type]

    def __len__(self) -> int:
        """Micro-batches per epoch for this rank (epoch 0; other epochs may differ in ``batch_tokens`` mode)."""
        return self.plan(0).n_steps * self.micro_batches


class _FlatSteps:
    """Steps collected as numpy arrays as they are planned (no Python object per sample kept for the epoch)."""

    def __init__(self) -> None:
        self.samples: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.overfull: list[bool] = []

    def add(self, step: StepPlan) -> None:
        mbs = [mb for r in step.ranks for mb in r]
        self.lengths.append(np.fromiter((len(mb) for mb in mbs), np.int64, len(mbs)))
        self.samples.append(np.fromiter((i for mb in mbs for i in mb), np.int64, int(self.lengths[-1].sum())))
        self.overfull.append(step.overfull)

    def plan(self, epoch: int, W: int, M: int, too_long: list[int]) -> EpochPlan:
        def cat(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)

        return EpochPlan(epoch, W, M, cat(self.samples), _cumsum0(cat(self.lengths)),
                         np.asarray(self.overfull, dtype=bool), list(too_long))
