"""The training data loader every recipe uses: manifest -> cost-balanced, packed micro-batches.

``build_dataloader`` reads the manifest, probes media (cached), estimates each sample's tokens and FLOPs
with the processor's own sizing rules, plans every epoch with :class:`~keye.data.sampler.BalancedSampler`
and decodes/preprocesses micro-batches in worker processes. The returned :class:`KeyeDataLoader`:

* yields this rank's micro-batches for one epoch per ``for`` loop (see :mod:`keye.data.collate` for the
  batch layout) and then moves on to the next epoch;
* has ``state_dict()`` / ``load_state_dict()`` (seed, epoch, position, counters) so a resumed run sees
  exactly the samples, in the same micro-batches, that an uninterrupted run would have seen; all
  randomness (shuffle, and torch/numpy/python RNG inside preprocessing, reseeded per micro-batch) derives
  from (seed, epoch, micro-batch index);
* resumes elastically: a state saved under another number of data-parallel ranks (or groups), micro-batches
  or batch size trains the rest of that epoch - every sample it had not yet handed out, once - under the new
  layout, and plans the epochs after it as usual; a state saved before the manifest grew finishes its epoch
  over the rows it started with (new rows join from the next epoch);
* plans each epoch once, on global rank 0, and broadcasts the plan; with ``group_size`` > 1, consecutive
  ranks form data-parallel groups (context parallelism) whose first rank reads and decodes and sends the
  collated micro-batches to the others (:mod:`keye.data.groups`);
* skips samples that fail (malformed rows, missing or corrupt media at probe time, decode errors at load
  time), logs each with its manifest line and reason, counts them in ``summary()``, and raises
  :class:`~keye.errors.KeyeInputError` once more than ``max_bad_fraction`` of the samples are bad.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from keye.data.collate import IGNORE_INDEX, collate_packed, collate_padded
from keye.data.groups import DataGroups
from keye.data.manifest import BadRow, Manifest, Sample
from keye.data.sampler import BalancedSampler, EpochPlan
from keye.data.table import (
    CostColumns,
    SampleTable,
    cost_fingerprint,
    estimate_costs,
    merge_costs,
    open_table,
)
from keye.errors import KeyeConfigError, KeyeInputError

log = logging.getLogger(__name__)
STATE_VERSION = 2
# Below this many attempted samples a high bad fraction is noise (2 bad of the first 3); the threshold is
# always enforced at the end of an epoch.
MIN_SAMPLES_FOR_BAD_CHECK = 64


class SupportsCost(Protocol):
    """What the loader needs from a cost model (see :class:`keye.data.cost.CostModel`)."""

    def estimate(self, sample: Sample) -> Any:  # returns an object with .tokens (int) and .flops (float)
        """Tokens and FLOPs of one sample; raises KeyeInputError when the sample is unusable."""
        ...


def _reseed(seed: int, epoch: int, mb: int) -> None:
    s = int(np.random.SeedSequence([seed, epoch, mb]).generate_state(1)[0])
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


class _MicroBatchDataset(Dataset):
    """Map-style dataset over one rank's remaining micro-batches of one epoch (runs in workers; each sample is
    read from the table here, when its micro-batch is made)."""

    def __init__(
        self,
        table: SampleTable,
        processor: Any,
        plan: list[list[int]],
        start: int,
        *,
        packing: bool,
        pad_token_id: int,
        seed: int,
        epoch: int,
        processor_kwargs: dict[str, Any],
        spare: Sequence[int] = (),
    ):
        self.table, self.processor, self.plan, self.start = table, processor, plan, start
        self.packing, self.pad_token_id = packing, pad_token_id
        self.seed, self.epoch, self.kwargs = seed, epoch, processor_kwargs
        # Samples of other ranks to borrow for an all-masked micro-batch when this rank's plan has none that
        # loads (the rest of an elastically resumed epoch can leave a rank empty micro-batches).
        self.spare = list(spare)

    def __len__(self) -> int:
        return len(self.plan) - self.start

    def _process(self, i: int, sample: Sample | None = None) -> dict[str, Any]:
        sample = sample if sample is not None else self.table.sample(i)
        out = self.processor([sample.messages], return_tensors="pt", for_training=True, **self.kwargs)
        return dict(out)

    def __getitem__(self, k: int) -> dict[str, Any]:
        mb = self.start + k
        _reseed(self.seed, self.epoch, mb)
        outs, ids, lines, bad = [], [], [], []
        for i in self.plan[mb]:
            sample = None
            try:
                sample = self.table.sample(i)
                outs.append(self._process(i, sample))
                ids.append(i)
                lines.append(sample.line)
            except Exception as err:  # noqa: BLE001 - any read/decode/preprocess failure is a bad *sample*
                line, sid = (sample.line, sample.id) if sample is not None else (0, self.table.where(i))
                bad.append({"index": i, "line": line, "id": sid, "reason": f"{type(err).__name__}: {err}"})
        dummy = False
        if not outs:
            outs = [self._fallback(mb)]
            dummy = True
        batch = collate_packed(outs) if self.packing else collate_padded(outs, self.pad_token_id)
        if dummy:
            # Every sample of this micro-batch failed. Data-parallel ranks must still run a forward/backward,
            # so we give them a real sample with every label masked: it contributes zero loss and gradient.
            batch["labels"] = torch.full_like(batch["input_ids"], IGNORE_INDEX)
            batch["num_samples"] = 0
            batch["num_label_tokens"] = 0
        batch["sample_ids"] = ids
        batch["sample_lines"] = lines
        batch["bad"] = bad
        batch["epoch"] = self.epoch
        batch["micro_batch"] = mb
        return batch

    def _fallback(self, mb: int) -> dict[str, Any]:
        n = len(self.plan)
        for off in range(1, n):
            for i in self.plan[(mb + off) % n]:
                try:
                    return self._process(i)
                except Exception:  # noqa: BLE001 - keep looking for any usable sample
                    continue
        for i in self.spare:
            try:
                return self._process(i)
            except Exception:  # noqa: BLE001 - keep looking for any usable sample
                continue
        raise KeyeInputError(f"no sample of epoch {self.epoch} can be processed on this rank")


def _identity(x: Any) -> Any:
    return x


class KeyeDataLoader:
    """Iterable over this rank's micro-batches; one ``for`` loop = the rest of the current epoch.

    Attributes:
        table: the :class:`~keye.data.table.SampleTable` samples are read from.
        manifest: the parsed :class:`Manifest` when the table is one held in memory (a JSONL file), else ``None``.
        sampler: the :class:`BalancedSampler` (same plan on every rank; its world is the data-parallel groups).
        groups: the process layout (:class:`~keye.data.groups.DataGroups`: group size, who reads).
        costs: per-sample cost columns (:class:`~keye.data.table.CostColumns`; ``costs[i]`` is ``None`` for
            samples excluded before training).
        bad_rows: every bad sample so far (plan-time and load-time), as :class:`BadRow`.
    """

    def __init__(
        self,
        table: SampleTable,
        processor: Any,
        sampler: BalancedSampler,
        costs: CostColumns,
        plan_bad: list[BadRow],
        *,
        packing: bool,
        num_workers: int,
        prefetch_factor: int,
        pin_memory: bool,
        max_bad_fraction: float,
        pad_token_id: int,
        processor_kwargs: dict[str, Any] | None = None,
        bad_log: str | os.PathLike[str] | None = None,
        groups: DataGroups | None = None,
    ):
        self.table, self.processor, self.sampler, self.costs = table, processor, sampler, costs
        self.groups = groups if groups is not None else DataGroups(sampler.world_size, sampler.rank)
        self.manifest: Manifest | None = getattr(table, "manifest", None)
        self.packing, self.num_workers, self.prefetch_factor = packing, num_workers, prefetch_factor
        self.pin_memory, self.max_bad_fraction, self.pad_token_id = pin_memory, max_bad_fraction, pad_token_id
        self.processor_kwargs = dict(processor_kwargs or {})
        self.bad_log = Path(bad_log) if bad_log is not None else None
        self.plan_bad = list(plan_bad)
        self.load_bad: list[BadRow] = []
        self.epoch = 0
        self.position = 0
        self.samples_ok = 0
        self.samples_bad = 0
        self.micro_batches_done = 0
        self.dummy_micro_batches = 0
        self.epoch_samples_ok = 0
        self.epoch_samples_bad = 0
        # The current epoch's plan covers the samples < epoch_rows (None: all) not in epoch_done (None: none);
        # both are set only by an elastic resume (or one across a grown manifest) and cleared with the epoch.
        self.epoch_rows: int | None = None
        self.epoch_done: np.ndarray | None = None
        self._shared: tuple[tuple, EpochPlan] | None = None
        for b in self.plan_bad:
            self._write_bad(b, stage="plan")

    # ------------------------------------------------------------------ plan
    def _plan_key(self) -> tuple:
        done = None if self.epoch_done is None else hashlib.sha1(self.epoch_done.tobytes()).hexdigest()
        return self.epoch, self.epoch_rows, done

    def epoch_plan(self, *, share: bool = False) -> EpochPlan:
        """The current epoch's plan (all ranks). ``share``: made on global rank 0 and broadcast to every rank
        (a collective: every rank calls it at the same point; the loader does at build time and at the start of
        each epoch's iteration); without it the plan shared last is reused when it is the current one, else
        this rank plans the same plan itself."""
        key = self._plan_key()
        if self._shared is not None and self._shared[0] == key:
            return self._shared[1]

        def make() -> EpochPlan:
            return self.sampler.plan(self.epoch, done=self.epoch_done, limit=self.epoch_rows)

        if not share:
            return make()
        plan = self.groups.share(make)
        self._shared = (key, plan)
        return plan

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Micro-batches in the current epoch for this rank (the whole epoch, resumed or not)."""
        return self.epoch_plan().n_steps * self.sampler.micro_batches

    def _batches(self, plan: EpochPlan) -> Iterator[dict[str, Any]]:
        """This rank's collated micro-batches from ``position`` on: read and decoded here (in worker processes
        when ``num_workers`` > 0) by a group's reader, received from it by the group's other ranks."""
        mbs = plan.rank_micro_batches(self.sampler.rank)
        if not self.groups.is_reader:
            for _ in range(len(mbs) - self.position):
                yield self.groups.broadcast_batch(None)
            return
        ds = _MicroBatchDataset(
            self.table,
            self.processor,
            mbs,
            self.position,
            packing=self.packing,
            pad_token_id=self.pad_token_id,
            seed=self.sampler.seed,
            epoch=self.epoch,
            processor_kwargs=self.processor_kwargs,
            spare=plan.samples[:64].tolist(),
        )
        kw: dict[str, Any] = {}
        if self.num_workers > 0:
            kw["prefetch_factor"] = self.prefetch_factor
        dl = DataLoader(
            ds,
            batch_size=None,
            shuffle=False,
            num_workers=self.num_workers,
            collate_fn=_identity,
            pin_memory=self.pin_memory,
            **kw,
        )
        for batch in dl:
            yield self.groups.broadcast_batch(batch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self._batches(self.epoch_plan(share=True)):
            self.position += 1
            self._account(batch)
            yield batch
        self._check_bad(final=True)
        self.epoch += 1
        self.position = 0
        self.epoch_samples_ok = self.epoch_samples_bad = 0
        self.epoch_rows = self.epoch_done = None

    def _account(self, batch: dict[str, Any]) -> None:
        self.micro_batches_done += 1
        self.samples_ok += batch["num_samples"]
        self.epoch_samples_ok += batch["num_samples"]
        if batch["num_samples"] == 0:
            self.dummy_micro_batches += 1
        for b in batch["bad"]:
            row = BadRow(b["line"], b["reason"], b["id"])
            self.load_bad.append(row)
            self.samples_bad += 1
            self.epoch_samples_bad += 1
            log.warning("skipping bad sample: %s", row)
            self._write_bad(row, stage="load")
        self._check_bad(final=False)

    def _write_bad(self, row: BadRow, stage: str) -> None:
        if self.bad_log is None:
            return
        self.bad_log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.bad_log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"stage": stage, "line": row.line, "id": row.id, "reason": row.reason}) + "\n")

    def bad_fraction(self) -> float:
        """Bad samples / all samples attempted so far (plan-time bad rows count against the whole manifest)."""
        n_rows = self.table.num_rows
        plan_frac = len(self.plan_bad) / max(1, n_rows)
        att = self.epoch_samples_ok + self.epoch_samples_bad
        load_frac = self.epoch_samples_bad / att if att else 0.0
        return plan_frac + load_frac * (1.0 - plan_frac)

    def _check_bad(self, final: bool) -> None:
        att = self.epoch_samples_ok + self.epoch_samples_bad
        if not final and att < MIN_SAMPLES_FOR_BAD_CHECK:
            return
        frac = self.bad_fraction()
        if frac > self.max_bad_fraction:
            examples = "; ".join(str(b) for b in (self.plan_bad + self.load_bad)[:5])
            raise KeyeInputError(
                f"{frac:.1%} of samples are bad, above max_bad_fraction={self.max_bad_fraction:.1%} "
                f"({len(self.plan_bad)} rejected before training, {self.samples_bad} failed to load); "
                f"first: {examples}",
                path=self.table.path,
            )

    # ------------------------------------------------------------------ resume
    def _layout(self) -> dict[str, Any]:
        """What the plan of an epoch depends on besides the seed and the costs."""
        smp = self.sampler
        return {"world_size": smp.world_size, "micro_batches": smp.micro_batches, "batch_size": smp.batch_size,
                "batch_tokens": smp.batch_tokens, "fill": smp.fill, "shuffle": smp.shuffle,
                "length_grouped": smp.length_grouped}

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly here: seed, epoch, position (micro-batches consumed in the
        epoch), the layout it was planned for, the samples of the epoch already handed out to any rank (a bit
        per row: what an elastic resume trains the rest of the epoch from) and the counters."""
        rows = self.epoch_rows if self.epoch_rows is not None else len(self.table)
        consumed = self.epoch_plan().consumed(self.position)
        if self.epoch_done is not None:
            consumed = np.union1d(consumed, self.epoch_done)
        return {
            "version": STATE_VERSION,
            "seed": self.sampler.seed,
            "epoch": self.epoch,
            "position": self.position,
            "world_size": self.sampler.world_size,
            "group_size": self.groups.group_size,
            "rank": self.groups.rank,
            "layout": self._layout(),
            "num_samples": len(self.table),
            "epoch_rows": rows,
            "epoch_done": None if self.epoch_done is None else _pack(self.epoch_done, rows),
            "consumed": _pack(consumed, rows),
            "counters": {
                "samples_ok": self.samples_ok,
                "samples_bad": self.samples_bad,
                "micro_batches_done": self.micro_batches_done,
                "dummy_micro_batches": self.dummy_micro_batches,
                "epoch_samples_ok": self.epoch_samples_ok,
                "epoch_samples_bad": self.epoch_samples_bad,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (this version's or the previous one's).

        Under the same layout (data-parallel groups, micro-batches, batch size or tokens) the run continues
        exactly where it stopped. Under another layout (more or fewer ranks or groups) it trains the samples
        of the interrupted epoch that no rank had been handed yet, each once, planned for the new layout; the
        following epochs are planned as usual. A state made before the manifest grew (rows appended) finishes
        its epoch over the rows it started with; the new rows join from the next epoch. The counters are the
        saving rank's (any rank's state will do).

        Raises:
            KeyeConfigError: another seed, a manifest with fewer rows than the state's epoch, or a state of the
                previous version (which records no handed-out samples) under another world size.
        """
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise KeyeConfigError(f"loader state version {version} is not 1 or {STATE_VERSION}")
        if state["seed"] != self.sampler.seed:
            raise KeyeConfigError(f"loader state has seed={state['seed']} but this loader has seed={self.sampler.seed}")
        rows = int(state.get("epoch_rows", state["num_samples"]))
        if rows > len(self.table):
            raise KeyeConfigError(f"loader state is for an epoch over {rows} samples but {self.table.path} now has "
                                  f"{len(self.table)}: resuming needs the rows it started with (append new ones)")
        position, done = int(state["position"]), None
        if version == 1:
            if state["world_size"] != self.sampler.world_size:
                raise KeyeConfigError(f"loader state has world_size={state['world_size']} but this loader has "
                                      f"world_size={self.sampler.world_size} (a version-1 state resumes on the same "
                                      "number of ranks only)")
        elif state["layout"] == self._layout():
            done = None if state["epoch_done"] is None else _unpack(state["epoch_done"], rows)
        else:
            done, position = _unpack(state["consumed"], rows), 0
            log.info("resuming epoch %d on a new layout (%s, was %s): %d of its samples already trained",
                     state["epoch"], self._layout(), state["layout"], len(done))
        self.epoch, self.position = int(state["epoch"]), position
        self.epoch_rows = rows if rows != len(self.table) else None
        self.epoch_done = done
        for k, v in state["counters"].items():
            setattr(self, k, int(v))

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.epoch, self.position = int(epoch), 0
        self.epoch_samples_ok = self.epoch_samples_bad = 0
        self.epoch_rows = self.epoch_done = None

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """Run summary: counts of samples loaded and skipped, and why they were skipped."""
        reasons = Counter(_reason_key(b.reason) for b in self.plan_bad + self.load_bad)
        return {
            "manifest": str(self.table.path),
            "rank": self.sampler.rank,
            "world_size": self.sampler.world_size,
            "epoch": self.epoch,
            "position": self.position,
            "micro_batches": self.micro_batches_done,
            "samples_ok": self.samples_ok,
            "bad_before_training": len(self.plan_bad),
            "bad_while_loading": self.samples_bad,
            "dummy_micro_batches": self.dummy_micro_batches,
            "bad_fraction": round(self.bad_fraction(), 6),
            "bad_reasons": dict(reasons.most_common()),
        }

    def format_summary(self) -> str:
        """:meth:`summary` as a few human-readable lines."""
        s = self.summary()
        lines = [
            f"data: {s['samples_ok']} samples in {s['micro_batches']} micro-batches (rank {s['rank']}/"
            f"{s['world_size']}, epoch {s['epoch']})",
            f"data: skipped {s['bad_before_training']} before training and {s['bad_while_loading']} while "
            f"loading (bad fraction {s['bad_fraction']:.2%})",
        ]
        lines += [f"data:   {n} x {r}" for r, n in s["bad_reasons"].items()]
        return "\n".join(lines)


def _pack(indices: np.ndarray, rows: int) -> bytes:
    """Sample indices < ``rows`` as a bitmap (a bit per row: 125 KB per million)."""
    mask = np.zeros(rows, bool)
    mask[np.asarray(indices, dtype=np.int64)] = True
    return np.packbits(mask).tobytes()


def _unpack(bits: bytes, rows: int) -> np.ndarray:
    """The indices :func:`_pack` packed."""
    return np.flatnonzero(np.unpackbits(np.frombuffer(bits, np.uint8), count=rows)).astype(np.int64)


def _reason_key(reason: str) -> str:
    """Group reasons by their kind (text before the first ':' or first 60 chars)."""
    return reason.split(":", 1)[0][:60]


def _dist_layout(world_size: int | None, rank: int | None) -> tuple[int, int]:
    if world_size is not None and rank is not None:
        return world_size, rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ws, rk = torch.distributed.get_world_size(), torch.distributed.get_rank()
    else:
        ws, rk = 1, 0
    return (world_size if world_size is not None else ws), (rank if rank is not None else rk)


def estimate_all(
    table: SampleTable | Manifest, cost_model: SupportsCost, *, shard: tuple[int, int] = (0, 1)
) -> tuple[CostColumns, list[BadRow]]:
    """Run the cost model over the samples of one shard (``index % n == k`` for ``shard=(k, n)``).

    Returns the cost columns (``costs[i]`` is ``None`` for samples outside the shard or rejected) and the
    rejected samples as :class:`BadRow` (the cost model raises :class:`KeyeInputError` for missing/corrupt
    media and for media the processor's sizing rules refuse).
    """
    return estimate_costs(open_table(table), cost_model, shard=shard)


def _cost_workers(workers: int | None, n: int) -> int:
    """``cost_workers`` resolved: ``None`` -> up to 4 processes (one per core) for a share of 2,000+ samples."""
    if workers is not None:
        return max(0, int(workers))
    return min(4, os.cpu_count() or 1) if n >= 2000 else 0


def _estimate_distributed(
    table: SampleTable, cost_model: SupportsCost, world_size: int, rank: int, workers: int | None = None,
) -> tuple[CostColumns, list[BadRow]]:
    """Each rank probes/estimates 1/world of the samples (in ``workers`` processes, see :func:`_cost_workers`),
    then all ranks exchange results, so a cold probe cache costs every rank 1/world of the work (falls back to
    all samples without a matching process group).
    """
    from keye.data.cost import estimate_parallel

    dist = torch.distributed
    progress = len(table) >= 10_000
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size > 1):
        return estimate_parallel(table, cost_model, workers=_cost_workers(workers, len(table)), progress=progress)
    cols, bad = estimate_parallel(table, cost_model, shard=(rank, world_size), progress=progress,
                                  workers=_cost_workers(workers, len(table) // world_size))
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (cols, bad))
    merged = merge_costs([g[0] for g in gathered])
    all_bad = sorted((b for g in gathered for b in g[1]), key=lambda b: b.line)
    return merged, all_bad


def _table_costs(
    table: SampleTable, processor: Any, cost_model: SupportsCost | None, probe_cache: Any,
    processor_kwargs: dict[str, Any] | None, world_size: int, rank: int, workers: int | None = None,
) -> tuple[CostColumns, list[BadRow]]:
    """The cost columns of ``table``: the ones stored in an index when they were made for this processor and
    thinking mode (and no other cost model was asked for), else estimated now (split over the ranks)."""
    if cost_model is None:
        from keye.data.cost import CostModel

        mode = (processor_kwargs or {}).get("mode")  # the cost model must render prompts as the loader will
        cost_model = CostModel.from_processor(processor, cache=probe_cache, mode=mode)
        stored = table.stored_costs(cost_fingerprint(cost_model))
        if stored is not None:
            return stored, []
    if len(table) >= 10_000:
        log.warning("estimating the costs of %d samples now (%s); build an index with 'keye data index "
                    "--processor ...' for this processor to skip this", len(table), table.path)
    return _estimate_distributed(table, cost_model, world_size, rank, workers)


def build_dataloader(
    manifest: str | os.PathLike[str] | Manifest | SampleTable,
    processor: Any,
    *,
    root: str | os.PathLike[str] | None = None,
    batch_tokens: int | None = None,
    batch_size: int | None = None,
    micro_batches: int = 1,
    world_size: int | None = None,
    rank: int | None = None,
    seed: int = 0,
    num_workers: int = 2,
    packing: bool = True,
    prefetch_factor: int = 2,
    pin_memory: bool | None = None,
    shuffle: bool = True,
    group_key: str | None = None,
    max_bad_fraction: float = 0.05,
    cost_model: SupportsCost | None = None,
    probe_cache: Any = None,
    bad_log: str | os.PathLike[str] | None = None,
    fill: float = 0.9,
    processor_kwargs: dict[str, Any] | None = None,
    group_size: int = 1,
    cost_workers: int | None = None,
) -> KeyeDataLoader:
    """Build the training loader for this rank.

    Args:
        manifest: an index directory made by ``keye data index`` (samples are read lazily, each by the rank and
            worker that trains it; its stored costs are used when made for this processor and mode), a JSONL
            path (read whole: small sets), an already parsed :class:`Manifest`, or any
            :class:`~keye.data.table.SampleTable`.
        processor: a :class:`keye.processing.KeyeProcessor` (or anything called as
            ``processor([messages], return_tensors="pt", for_training=True)`` returning a dict with
            ``input_ids`` [1, L] and optionally ``labels`` and media tensors).
        root: directory relative media paths are relative to (default: the manifest's directory).
        batch_tokens: token budget of one micro-batch (a packed row), or
        batch_size: average samples per micro-batch per rank; exactly one of the two.
        micro_batches: micro-batches per rank per optimizer step (gradient accumulation).
        world_size, rank: processes and this one's rank (default: from ``torch.distributed`` if initialised,
            else 1/0); with ``group_size`` 1 they are the data-parallel layout.
        seed: shuffling and preprocessing seed.
        num_workers: decoding/preprocessing worker processes (0 = in this process).
        packing: ``True`` -> one packed row per micro-batch; ``False`` -> padded batch.
        pin_memory: default ``torch.cuda.is_available()``.
        group_key: manifest field (e.g. ``"group"``) whose equal values stay on one rank (RL groups).
        cost_model: default :class:`keye.data.cost.CostModel` built from ``processor`` (an explicit one is always
            run, even over an index with stored costs).
        max_bad_fraction: fail (``KeyeInputError``) when more than this share of samples is bad.
        probe_cache: a :class:`keye.data.probe.ProbeCache` (default: the user cache).
        bad_log: optional JSONL file receiving one line per skipped sample.
        group_size: ranks per data-parallel group (``train.context_parallel``): *consecutive* ranks form a
            group (group = rank // group_size, ``world_size`` must be a multiple). Samples are balanced over the
            ``world_size / group_size`` groups; every rank of a group yields the same micro-batches; only the
            group's first rank reads and decodes them (in its worker processes) and sends the collated tensors
            to the others over a gloo process group (with a matching initialised ``torch.distributed``;
            otherwise each rank reads them itself, with the same result). Resume state is unchanged.
        cost_workers: processes estimating this rank's share of the costs when they are not stored in an index
            (0: in this process; default: up to 4 for a share of 2,000 samples or more).

    Raises:
        KeyeInputError: unreadable manifest, or too many bad rows before training starts.
        KeyeConfigError: inconsistent batching arguments.
    """
    table = open_table(manifest, root)
    world_size, rank = _dist_layout(world_size, rank)
    layout = DataGroups(world_size, rank, group_size)
    costs, cost_bad = _table_costs(table, processor, cost_model, probe_cache, processor_kwargs, world_size, rank,
                                   cost_workers)
    plan_bad = list(table.bad_rows) + cost_bad
    n_rows = table.num_rows
    if n_rows and len(plan_bad) / n_rows > max_bad_fraction:
        examples = "; ".join(str(b) for b in plan_bad[:5])
        raise KeyeInputError(
            f"{len(plan_bad)} of {n_rows} rows are unusable ({len(plan_bad) / n_rows:.1%} > "
            f"max_bad_fraction={max_bad_fraction:.1%}); first: {examples}",
            path=table.path,
        )
    for b in plan_bad:
        log.warning("skipping bad row: %s", b)
    tokens, flops = costs.tokens, costs.flops
    groups: Sequence[object] | None = None
    if group_key is not None:
        groups = table.column(group_key)
    sampler = BalancedSampler(
        tokens, flops, world_size=layout.num_groups, rank=layout.group, batch_size=batch_size, batch_tokens=batch_tokens,
        micro_batches=micro_batches, groups=groups, exclude=costs.excluded, seed=seed, shuffle=shuffle, fill=fill,
        length_grouped=not packing and batch_size is not None and micro_batches > 1,
    )
    for i in sampler.too_long:
        s = table.sample(i)
        plan_bad.append(BadRow(s.line, f"sample has {tokens[i]} tokens, more than batch_tokens={batch_tokens}", s.id))
    tok = getattr(processor, "tokenizer", None)
    pad_id = getattr(tok, "pad_token_id", None)
    if pad_id is None:
        pad_id = 0
    loader = KeyeDataLoader(
        table,
        processor,
        sampler,
        costs,
        plan_bad,
        packing=packing,
        num_workers=num_workers,
        prefetch_factor=prefetch_factor,
        pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
        max_bad_fraction=max_bad_fraction,
        pad_token_id=int(pad_id),
        processor_kwargs=processor_kwargs,
        bad_log=bad_log,
        groups=layout.connect(),
    )
    loader.epoch_plan(share=True)  # epoch 0 planned once (rank 0), before anyone asks for len(loader)
    return loader
