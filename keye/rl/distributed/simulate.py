"""Discrete-event simulation of RL throughput on a GPU cluster: synchronous vs asynchronous (SeamlessFlow-style)
rollouts with long-tailed answer lengths.

Model (every cost is a parameter of :class:`ClusterConfig`; ``benchmarks/rl_async.py`` measures them):

- **Answers.** Update ``b`` trains on ``batch_prompts`` groups of ``group_size`` answers. Answer lengths are
  lognormal, ``round(exp(N(length_mu, length_sigma)))`` clipped to ``[1, max_tokens]``, drawn once per
  (group, sample) slot from ``seed``: the synchronous and asynchronous runs see the same answers, and both
  train on every admitted answer in admission order, so neither can gain by skipping long answers.
- **Decoding.** A GPU decodes up to ``max_concurrent`` answers together (continuous batching: a finished
  answer's slot is refilled from the queue at once). One decode step gives every active answer one token
  and takes ``decode_step_s + decode_token_s * n_active`` seconds; progress is treated as continuous
  between events (a fluid approximation of the step loop). Starting an answer on a GPU, or continuing a
  partial one there, first costs ``prefill_token_s`` per context token (prompt + tokens so far), during
  which that GPU decodes nothing. New work goes to the GPU with the fewest active answers.
- **Training.** An update over a batch takes ``train_token_s * tokens / n_train_gpus + train_step_s``
  (data parallel, ``tokens`` = prompt + answer tokens of the batch), then the new weights are synced to
  every rollout GPU, which pauses them for ``sync_s``.
- **Synchronous** (``max_staleness = 0``, ``placement = "colocated"``): all GPUs generate batch ``b``; when
  its last answer ends all GPUs train; then sync; then batch ``b + 1`` starts (keye's on-policy loop).
- **Asynchronous** (``max_staleness = k >= 1``): groups are admitted while ``g < (version + k + 1) *
  batch_prompts`` (:meth:`keye.rl.rollout.trajectory.TrajectoryManager.admissible_groups`), so answers of later
  batches fill the slots freed by the long tail of batch ``b``. Update ``b`` starts when batch ``b`` is
  complete. ``placement = "colocated"``: the update runs on all GPUs and the answers in flight are
  preempted (kept as partial answers, continued after the sync with a new prefill); ``"tagged"``
  (SeamlessFlow's tag scheduling): ``train_gpus`` GPUs carry the train tag and roll out whenever the trainer
  has nothing to do, being preempted when an update starts; the other GPUs roll out all the time, pausing
  only for the sync. Answers in flight continue under the new weights (partial rollouts). Every consumed
  answer's first token is at most ``k`` versions old; :class:`SimResult` reports the largest staleness seen.

Throughput is answers trained per second between the end of update ``warmup_steps`` and the end of the last
update (the end of an update is when its weights are live, after the sync).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from keye.errors import KeyeConfigError

PLACEMENTS = ("colocated", "tagged")
UPDATES = ("barrier", "streaming")
_EPS = 1e-6  # tokens: finish tolerance of the continuous progress


@dataclass(frozen=True)
class ClusterConfig:
    """Cluster, workload and cost parameters of :func:`simulate` (times in seconds, lengths in tokens)."""

    n_gpus: int = 64
    batch_prompts: int = 128
    group_size: int = 16
    steps: int = 10
    warmup_steps: int = 2
    length_mu: float = 6.0
    length_sigma: float = 1.0
    max_tokens: int = 4096
    prompt_tokens: int = 256
    max_concurrent: int = 32
    decode_step_s: float = 0.02
    decode_token_s: float = 0.0005
    prefill_token_s: float = 2e-5
    train_token_s: float = 1e-4
    train_step_s: float = 0.5
    sync_s: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        """Raise :class:`KeyeConfigError` naming the first invalid field."""
        for name in ("n_gpus", "batch_prompts", "group_size", "steps", "max_tokens", "max_concurrent"):
            if getattr(self, name) < 1:
                raise KeyeConfigError(f"ClusterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup_steps < self.steps:
            raise KeyeConfigError(f"ClusterConfig.warmup_steps must be in [0, steps), got {self.warmup_steps}")
        for name in ("prompt_tokens", "decode_step_s", "decode_token_s", "prefill_token_s", "train_token_s",
                     "train_step_s", "sync_s", "length_sigma"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise KeyeConfigError(f"ClusterConfig.{name} must be finite and >= 0, got {v}")
        if self.decode_step_s + self.decode_token_s <= 0:
            raise KeyeConfigError("ClusterConfig: decode_step_s + decode_token_s must be > 0 (free decoding)")

    def lengths(self, n_groups: int) -> np.ndarray:
        """Answer lengths [n_groups, group_size] of the first ``n_groups`` groups (int64); the same prefix for
        any ``n_groups`` with one seed."""
        rng = np.random.default_rng(self.seed)
        out = np.empty((n_groups, self.group_size), dtype=np.int64)
        for g in range(n_groups):  # row by row, so the first rows do not depend on n_groups
            draw = rng.lognormal(self.length_mu, self.length_sigma, self.group_size)
            out[g] = np.clip(np.rint(draw), 1, self.max_tokens)
        return out


@dataclass
class SimResult:
    """What :func:`simulate` measured.

    ``samples_per_s``: answers trained per second after the warm-up. ``update_end_s[v]``: when the weights of
    version ``v`` became live (``update_end_s[0] = 0``). ``max_staleness_seen``: largest ``version trained -
    version of the first token`` over consumed answers. ``partial``: consumed answers whose tokens span more
    than one version. ``preempted``: answers interrupted by an update (continued later). ``decode_busy``:
    fraction of GPU-seconds spent decoding (not idle, prefilling, training or syncing).
    """

    samples_per_s: float
    tokens_per_s: float
    update_end_s: list[float]
    max_staleness_seen: int
    partial: int
    preempted: int
    decode_busy: float
    placement: str
    max_staleness: int
    train_gpus: int
    mean_length: float = 0.0
    step_s: list[float] = field(default_factory=list)
    update: str = "barrier"
    reprefill_tokens: int = 0  # context tokens prefilled again after weight loads (answers in flight)


class _Seq:
    __slots__ = ("group", "sample", "length", "remaining", "start_version", "crossed")

    def __init__(self, group: int, sample: int, length: int):
        self.group, self.sample, self.length = group, sample, length
        self.remaining = float(length)
        self.start_version: int | None = None
        self.crossed = False  # an update happened between its first and last token


class _Gpu:
    __slots__ = ("idx", "training", "active", "t", "busy_until", "epoch", "busy_s")

    def __init__(self, idx: int):
        self.idx = idx
        self.training = False
        self.active: list[_Seq] = []
        self.t = 0.0  # progress of the active answers is accounted up to t
        self.busy_until = 0.0  # no decoding before this time (prefill or weight sync)
        self.epoch = 0  # invalidates scheduled events
        self.busy_s = 0.0


def simulate(cfg: ClusterConfig, max_staleness: int = 0, placement: str = "colocated",
             train_gpus: int | None = None, update: str = "barrier") -> SimResult:
    """Run the simulation described in the module docstring and return its :class:`SimResult`.

    ``max_staleness = 0`` with ``placement = "colocated"`` is synchronous RL. ``train_gpus`` (``"tagged"``
    only, 1..n_gpus): GPUs with the train tag. ``update``: ``barrier`` (update ``v`` starts when batch ``v`` is
    complete) or ``streaming`` (each group of batch ``v`` is trained as soon as it is complete, the optimizer
    steps when the batch is whole). Deterministic for a given ``cfg`` (including ``seed``).
    """
    cfg.validate()
    if placement not in PLACEMENTS:
        raise KeyeConfigError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
    if update not in UPDATES:
        raise KeyeConfigError(f"update must be one of {UPDATES}, got {update!r}")
    if update == "streaming" and max_staleness == 0:
        raise KeyeConfigError("a streaming update needs max_staleness >= 1 (synchronous RL trains whole batches)")
    if max_staleness < 0:
        raise KeyeConfigError(f"max_staleness must be >= 0, got {max_staleness}")
    n_train = cfg.n_gpus if placement == "colocated" else train_gpus
    if n_train is None or not 1 <= n_train <= cfg.n_gpus:
        raise KeyeConfigError(f"train_gpus must be in 1..{cfg.n_gpus} for placement 'tagged', got {train_gpus}")
    return _Sim(cfg, max_staleness, placement, n_train, update == "streaming").run()


class _Sim:
    def __init__(self, cfg: ClusterConfig, k: int, placement: str, n_train: int, streaming: bool = False):
        self.cfg, self.k, self.placement, self.n_train, self.streaming = cfg, k, placement, n_train, streaming
        self.B = cfg.batch_prompts
        self.total_groups = (cfg.steps + k + 1) * self.B
        self.lengths = cfg.lengths(self.total_groups)
        self.gpus = [_Gpu(i) for i in range(cfg.n_gpus)]
        self.events: list[tuple[float, int, str, int, int]] = []
        self.counter = 0
        self.queue: list[tuple[int, int, _Seq]] = []  # (group, sample, seq): oldest group first
        self.version = 0
        self.admitted = 0
        self.group_left: list[int] = []
        self.batch_left = [self.B] * (cfg.steps + k + 1)
        self.batch_seqs: list[list[_Seq]] = [[] for _ in range(cfg.steps + k + 1)]
        self.trainer_busy = False
        self.update_end = [0.0]
        self.max_stale = 0
        self.partial = 0
        self.preempted = 0
        self.consumed_tokens: list[int] = []
        self.complete: list[list[int]] = [[] for _ in range(cfg.steps + k + 1)]  # per batch: groups done, untrained
        self.reprefill_tokens = 0

    # ------------------------------------------------------------------------------------------- events
    def push(self, t: float, kind: str, idx: int = -1, epoch: int = -1) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, kind, idx, epoch))

    def step_time(self, n: int) -> float:
        return self.cfg.decode_step_s + self.cfg.decode_token_s * n

    def settle(self, g: _Gpu, now: float) -> None:
        """Advance g's active answers to ``now``."""
        start = max(g.t, g.busy_until)
        if g.active and now > start:
            progress = (now - start) / self.step_time(len(g.active))
            for s in g.active:
                s.remaining -= progress
            g.busy_s += now - start
        g.t = max(g.t, now)

    def schedule(self, g: _Gpu) -> None:
        g.epoch += 1
        if g.training or not g.active:
            return
        start = max(g.t, g.busy_until)
        left = max(0.0, min(s.remaining for s in g.active))
        self.push(start + left * self.step_time(len(g.active)), "gpu", g.idx, g.epoch)

    def add(self, g: _Gpu, seqs: list[_Seq], now: float) -> None:
        ctx = 0
        for s in seqs:
            if s.start_version is None:
                s.start_version = self.version
            ctx += self.cfg.prompt_tokens + int(round(s.length - s.remaining))
            g.active.append(s)
        if seqs:
            g.busy_until = max(g.busy_until, now) + self.cfg.prefill_token_s * ctx

    def feed(self, now: float, only: _Gpu | None = None) -> None:
        """Give queued answers to rollout GPUs with free slots, fewest active answers first."""
        cands = [only] if only is not None else [g for g in self.gpus if not g.training]
        heap = []
        for g in cands:
            if not g.training and len(g.active) < self.cfg.max_concurrent:
                heap.append((len(g.active), g.idx))
        if not heap or not self.queue:
            return
        heapq.heapify(heap)
        new: dict[int, list[_Seq]] = {}
        while heap and self.queue:
            n, idx = heapq.heappop(heap)
            seq = heapq.heappop(self.queue)[2]
            new.setdefault(idx, []).append(seq)
            if n + 1 < self.cfg.max_concurrent:
                heapq.heappush(heap, (n + 1, idx))
        for idx, seqs in new.items():
            g = self.gpus[idx]
            self.settle(g, now)
            self.add(g, seqs, now)
            self.schedule(g)

    def admit(self) -> None:
        limit = min(self.total_groups, (self.version + self.k + 1) * self.B)
        while self.admitted < limit:
            gid = self.admitted
            self.admitted += 1
            self.group_left.append(self.cfg.group_size)
            for j in range(self.cfg.group_size):
                s = _Seq(gid, j, int(self.lengths[gid, j]))
                self.batch_seqs[gid // self.B].append(s)
                heapq.heappush(self.queue, (gid, j, s))

    # ------------------------------------------------------------------------------------------ handlers
    def on_gpu(self, g: _Gpu, now: float) -> None:
        self.settle(g, now)
        done = [s for s in g.active if s.remaining <= _EPS]
        g.active = [s for s in g.active if s.remaining > _EPS]
        for s in done:
            s.remaining = 0.0
            self.group_left[s.group] -= 1
            if self.group_left[s.group] == 0:
                self.batch_left[s.group // self.B] -= 1
                self.complete[s.group // self.B].append(s.group)
        self.feed(now, only=g)
        self.schedule(g)
        self.try_train(now)

    def try_train(self, now: float) -> None:
        b = self.version
        if self.trainer_busy or b >= self.cfg.steps:
            return
        if self.streaming:
            self._stream(now, b)
            return
        if self.batch_left[b] > 0:
            return
        self.trainer_busy = True
        self._take_train_gpus(now)
        tokens = self._consume(b)
        dur = self.cfg.train_token_s * tokens / self.n_train + self.cfg.train_step_s
        self.push(now + dur, "train_done")
        self.feed(now)

    def _stream(self, now: float, b: int) -> None:
        """Streaming update: train batch ``b``'s complete groups now (the train GPUs leave rollout for it); when
        the batch is whole and every group trained, the optimizer step; otherwise the train GPUs roll out again."""
        groups, self.complete[b] = self.complete[b], []
        if groups:
            self.trainer_busy = True
            self._take_train_gpus(now)
            tokens = sum(self.cfg.group_size * self.cfg.prompt_tokens + int(self.lengths[g].sum()) for g in groups)
            self.push(now + self.cfg.train_token_s * tokens / self.n_train, "part_done")
            self.feed(now)
        elif self.batch_left[b] == 0:
            self.trainer_busy = True
            self._take_train_gpus(now)
            self._consume(b)
            self.push(now + self.cfg.train_step_s, "train_done")
            self.feed(now)
        else:
            self._release_train_gpus(now)

    def _take_train_gpus(self, now: float) -> None:
        """The train-tagged GPUs stop rolling out; their answers go back to the queue (continued later)."""
        preempted = []
        for g in self.gpus[: self.n_train]:
            if g.training:
                continue
            self.settle(g, now)
            preempted.extend(g.active)
            g.active = []
            g.training = True
            g.epoch += 1
        for s in preempted:
            heapq.heappush(self.queue, (s.group, s.sample, s))
        self.preempted += len(preempted)

    def _release_train_gpus(self, now: float) -> None:
        """The trainer has nothing to do: the train GPUs roll out again."""
        released = False
        for g in self.gpus[: self.n_train]:
            if g.training:
                g.training, g.t = False, now
                g.epoch += 1
                released = True
        if released:
            self.feed(now)

    def _consume(self, b: int) -> int:
        """Record batch ``b``'s answers as trained (staleness, partial rollouts); returns its tokens."""
        tokens = 0
        for s in self.batch_seqs[b]:
            assert s.start_version is not None and s.remaining == 0.0
            self.max_stale = max(self.max_stale, b - s.start_version)
            self.partial += s.crossed
            tokens += self.cfg.prompt_tokens + s.length
        self.consumed_tokens.append(tokens)
        return tokens

    def on_part_done(self, now: float) -> None:
        self.trainer_busy = False
        self.try_train(now)

    def on_train_done(self, now: float) -> None:
        self.version += 1
        sync_end = now + self.cfg.sync_s
        self.update_end.append(sync_end)
        for g in self.gpus:
            if g.training:
                g.training = False
                g.t = now
                g.busy_until = sync_end
                g.epoch += 1
            else:
                # after loading the new weights every answer in flight is prefilled again (prompt + the tokens it
                # has), its KV cache having been computed with the old weights
                self.settle(g, now)
                ctx = sum(self.cfg.prompt_tokens + int(round(s.length - s.remaining)) for s in g.active)
                self.reprefill_tokens += ctx
                g.busy_until = max(g.busy_until, now) + self.cfg.sync_s + self.cfg.prefill_token_s * ctx
                self.schedule(g)
        # answers started and unfinished now continue under the new weights (partial rollouts)
        for s in [s for g in self.gpus for s in g.active] + [item[2] for item in self.queue]:
            if s.start_version is not None:
                s.crossed = True
        self.admit()
        self.feed(now)
        self.push(sync_end, "sync_done")

    def run(self) -> SimResult:
        self.admit()
        self.feed(0.0)
        while self.version < self.cfg.steps:
            if not self.events:
                raise RuntimeError(f"simulation stalled at version {self.version} (no pending event)")
            now, _, kind, idx, epoch = heapq.heappop(self.events)
            if kind == "gpu":
                g = self.gpus[idx]
                if epoch == g.epoch:
                    self.on_gpu(g, now)
            elif kind == "train_done":
                self.on_train_done(now)
            elif kind == "part_done":
                self.on_part_done(now)
            else:  # sync_done
                self.trainer_busy = False
                self.try_train(now)
        cfg = self.cfg
        end, start = self.update_end[cfg.steps], self.update_end[cfg.warmup_steps]
        n_steps = cfg.steps - cfg.warmup_steps
        samples = n_steps * cfg.batch_prompts * cfg.group_size
        busy = sum(g.busy_s for g in self.gpus) / (cfg.n_gpus * end) if end > 0 else 0.0
        return SimResult(
            samples_per_s=samples / (end - start),
            tokens_per_s=sum(self.consumed_tokens[cfg.warmup_steps:]) / (end - start),
            update_end_s=list(self.update_end), max_staleness_seen=self.max_stale, partial=self.partial,
            preempted=self.preempted, decode_busy=busy, placement=self.placement, max_staleness=self.k,
            train_gpus=self.n_train, mean_length=float(self.lengths[: cfg.steps * self.B].mean()),
            step_s=[b - a for a, b in zip(self.update_end, self.update_end[1:])],
            update="streaming" if self.streaming else "barrier", reprefill_tokens=self.reprefill_tokens,
        )


def compare(cfg: ClusterConfig, max_staleness: int = 1, train_gpus: list[int] | None = None,
            update: str = "barrier") -> tuple[SimResult, SimResult]:
    """Synchronous RL vs the best asynchronous placement with ``max_staleness`` and ``update`` (barrier or
    streaming): colocated, or tagged with each count in ``train_gpus``. By default the counts are searched as an
    operator would tune them: 1/16, 2/16, ..., 15/16 of the GPUs and all but one, then every count between the
    best one's neighbours on that grid. Returns ``(sync, async)``; ``async.samples_per_s / sync.samples_per_s`` is
    the speed-up."""
    sync = simulate(cfg, 0, "colocated")
    options = [simulate(cfg, max_staleness, "colocated", update=update)]
    grid = train_gpus if train_gpus is not None else sorted(
        {max(1, cfg.n_gpus * i // 16) for i in range(1, 16)} | {max(1, cfg.n_gpus - 1)})
    tagged = {t: simulate(cfg, max_staleness, "tagged", t, update=update) for t in grid}
    if train_gpus is None and tagged:
        best = max(tagged, key=lambda t: tagged[t].samples_per_s)
        i = grid.index(best)
        lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
        for t in range(lo + 1, hi):
            if t not in tagged:
                tagged[t] = simulate(cfg, max_staleness, "tagged", t, update=update)
    options += list(tagged.values())
    return sync, max(options, key=lambda r: r.samples_per_s)


def ceiling(cfg: ClusterConfig, max_staleness: int, sync: SimResult | None = None, update: str = "barrier") -> float:
    """Upper bound on ``async / sync`` samples per second for **any** asynchronous schedule with staleness
    ``k = max_staleness`` on this cluster and workload: the pipeline bound of docs/rl_async.md.

    Batch ``v`` can start only when the weights of version ``v - k`` are live (an answer trained by update
    ``v`` starts at most ``k`` versions earlier), and update ``v`` needs all of batch ``v``. So the ``k + 1``
    update periods that end with update ``v`` contain the generation of batch ``v``'s longest answer, at least
    ``T_v`` = its prompt's prefill plus ``L_v`` decode steps at the cheapest step cost (the answer alone on a
    device), then update ``v`` on all devices (``U_v``) and its sync ``S``: ``(k + 1) P >= mean(T_v + U_v) +
    S``; one period also holds one update: ``P >= mean(U_v) + S``. The bound is the synchronous run's
    samples/s at the smallest such ``P`` over ``sync.samples_per_s`` (``sync``: ``simulate(cfg, 0)``, run
    when not given). Means are over the timed updates (after ``warmup_steps``); the bound is asymptotic
    (a finite run's first and last periods are not accounted separately).

    A schedule reaches it only if it knows which answer is the longest before starting it (to give it a
    device alone) and trains without slowing any answer; with a decode step that costs the same for any
    number of answers (memory-bound decoding) the first condition is free and the bound is about ``k + 1``.

    With ``update = "streaming"`` the groups of batch ``v`` are trained while its tail still decodes, so after
    its longest answer only that answer's group (``u_v``, on all devices) and the optimizer step remain:
    ``(k + 1) P >= mean(T_v + u_v) + S`` (and still ``P >= mean(U_v) + S``).
    """
    if max_staleness < 0:
        raise KeyeConfigError(f"max_staleness must be >= 0, got {max_staleness}")
    cfg.validate()
    if sync is None:
        sync = simulate(cfg, 0)
    lengths = cfg.lengths(cfg.steps * cfg.batch_prompts)
    if update not in UPDATES:
        raise KeyeConfigError(f"update must be one of {UPDATES}, got {update!r}")
    gen, train, tail = [], [], []
    for b in range(cfg.warmup_steps, cfg.steps):
        batch = lengths[b * cfg.batch_prompts:(b + 1) * cfg.batch_prompts]
        gen.append(cfg.prefill_token_s * cfg.prompt_tokens
                   + int(batch.max()) * (cfg.decode_step_s + cfg.decode_token_s))
        tokens = int(batch.sum()) + batch.size * cfg.prompt_tokens
        train.append(cfg.train_token_s * tokens / cfg.n_gpus + cfg.train_step_s)
        last = batch[int(np.argmax(batch.max(axis=1)))]  # the group of the longest answer
        tail.append(cfg.train_token_s * (int(last.sum()) + last.size * cfg.prompt_tokens) / cfg.n_gpus + cfg.train_step_s)
    mean_gen, mean_train = sum(gen) / len(gen), sum(train) / len(train)
    after = sum(tail) / len(tail) if update == "streaming" else mean_train
    period = max(mean_train + cfg.sync_s, (mean_gen + after + cfg.sync_s) / (max_staleness + 1))
    samples = cfg.batch_prompts * cfg.group_size
    return samples / period / sync.samples_per_s
