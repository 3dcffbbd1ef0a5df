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
* skips samples that fail (malformed rows, missing or corrupt media at probe time, decode errors at load
  time), logs each with its manifest line and reason, counts them in ``summary()``, and raises
  :class:`~keye.errors.KeyeInputError` once more than ``max_bad_fraction`` of the samples are bad.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from keye.data.collate import IGNORE_INDEX, collate_packed, collate_padded
from keye.data.manifest import BadRow, Manifest, Sample, read_manifest
from keye.data.sampler import BalancedSampler
from keye.errors import KeyeConfigError, KeyeInputError

log = logging.getLogger(__name__)
STATE_VERSION = 1
# Below this many attempted samples a high bad fraction is noise (2 bad of the first 3); the threshold is
# always enforced at the end of an epoch.
MIN_SAMPLES_FOR_BAD_CHECK = 64


class SupportsCost(Protocol):
    """What the loader needs from a cost model (see :class:`keye.data.cost.CostModel`)."""

    def estimate(self, sample: Sample) -> Any:  # returns an object with .tokens (int) and .flops (float)
        """Tokens and FLOPs of one sample; raises KeyeInputError when the sample is unusable."""
        ...


@dataclass(frozen=True)
class _Item:
    index: int
    line: int
    id: str
    messages: list[dict[str, Any]]


def _reseed(seed: int, epoch: int, mb: int) -> None:
    s = int(np.random.SeedSequence([seed, epoch, mb]).generate_state(1)[0])
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


class _MicroBatchDataset(Dataset):
    """Map-style dataset over one rank's remaining micro-batches of one epoch (runs in workers)."""

    def __init__(
        self,
        items: list[_Item],
        processor: Any,
        plan: list[list[int]],
        start: int,
        *,
        packing: bool,
        pad_token_id: int,
        seed: int,
        epoch: int,
        processor_kwargs: dict[str, Any],
    ):
        self.items, self.processor, self.plan, self.start = items, processor, plan, start
        self.packing, self.pad_token_id = packing, pad_token_id
        self.seed, self.epoch, self.kwargs = seed, epoch, processor_kwargs

    def __len__(self) -> int:
        return len(self.plan) - self.start

    def _process(self, i: int) -> dict[str, Any]:
        out = self.processor([self.items[i].messages], return_tensors="pt", for_training=True, **self.kwargs)
        return dict(out)

    def __getitem__(self, k: int) -> dict[str, Any]:
        mb = self.start + k
        _reseed(self.seed, self.epoch, mb)
        outs, ids, bad = [], [], []
        for i in self.plan[mb]:
            try:
                outs.append(self._process(i))
                ids.append(i)
            except Exception as err:  # noqa: BLE001 - any decode/preprocess failure is a bad *sample*
                it = self.items[i]
                bad.append({"index": i, "line": it.line, "id": it.id, "reason": f"{type(err).__name__}: {err}"})
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
        batch["sample_lines"] = [self.items[i].line for i in ids]
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
        raise KeyeInputError(f"no sample of epoch {self.epoch} can be processed on this rank")


def _identity(x: Any) -> Any:
    return x


class KeyeDataLoader:
    """Iterable over this rank's micro-batches; one ``for`` loop = the rest of the current epoch.

    Attributes:
        sampler: the :class:`BalancedSampler` (same plan on every rank).
        costs: per-sample cost estimates (``None`` for samples excluded before training).
        bad_rows: every bad sample so far (plan-time and load-time), as :class:`BadRow`.
    """

    def __init__(
        self,
        manifest: Manifest,
        processor: Any,
        sampler: BalancedSampler,
        costs: list[Any | None],
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
    ):
        self.manifest, self.processor, self.sampler, self.costs = manifest, processor, sampler, costs
        self.packing, self.num_workers, self.prefetch_factor = packing, num_workers, prefetch_factor
        self.pin_memory, self.max_bad_fraction, self.pad_token_id = pin_memory, max_bad_fraction, pad_token_id
        self.processor_kwargs = dict(processor_kwargs or {})
        self.bad_log = Path(bad_log) if bad_log is not None else None
        self.items = [_Item(s.index, s.line, s.id, s.messages) for s in manifest.samples]
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
        for b in self.plan_bad:
            self._write_bad(b, stage="plan")

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """Micro-batches in the current epoch for this rank."""
        return len(self.sampler.micro_batches_for(self.epoch))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        plan = self.sampler.micro_batches_for(self.epoch)
        ds = _MicroBatchDataset(
            self.items,
            self.processor,
            plan,
            self.position,
            packing=self.packing,
            pad_token_id=self.pad_token_id,
            seed=self.sampler.seed,
            epoch=self.epoch,
            processor_kwargs=self.processor_kwargs,
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
            self.position += 1
            self._account(batch)
            yield batch
        self._check_bad(final=True)
        self.epoch += 1
        self.position = 0
        self.epoch_samples_ok = self.epoch_samples_bad = 0

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
        n_rows = len(self.manifest.samples) + len(self.manifest.bad_rows)
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
                path=self.manifest.path,
            )

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly here: seed, epoch, position (micro-batches consumed in the
        epoch), the layout it was planned for, and the counters."""
        return {
            "version": STATE_VERSION,
            "seed": self.sampler.seed,
            "epoch": self.epoch,
            "position": self.position,
            "world_size": self.sampler.world_size,
            "rank": self.sampler.rank,
            "num_samples": len(self.items),
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
        """Restore a :meth:`state_dict`.

        Raises:
            KeyeConfigError: the state was made with a different seed, world size or manifest size, under
                which "the same samples" is undefined.
        """
        if state.get("version") != STATE_VERSION:
            raise KeyeConfigError(f"loader state version {state.get('version')} != {STATE_VERSION}")
        for key, mine in (
            ("seed", self.sampler.seed),
            ("world_size", self.sampler.world_size),
            ("num_samples", len(self.items)),
        ):
            if state[key] != mine:
                raise KeyeConfigError(f"loader state has {key}={state[key]} but this loader has {key}={mine}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        for k, v in state["counters"].items():
            setattr(self, k, int(v))

    def set_epoch(self, epoch: int) -> None:
        """Jump to the start of ``epoch``."""
        self.epoch, self.position = int(epoch), 0
        self.epoch_samples_ok = self.epoch_samples_bad = 0

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """Run summary: counts of samples loaded and skipped, and why they were skipped."""
        reasons = Counter(_reason_key(b.reason) for b in self.plan_bad + self.load_bad)
        return {
            "manifest": str(self.manifest.path),
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
    manifest: Manifest, cost_model: SupportsCost, *, shard: tuple[int, int] = (0, 1)
) -> tuple[list[Any | None], list[BadRow]]:
    """Run the cost model over the samples of one shard (``index % n == k`` for ``shard=(k, n)``).

    Returns per-sample costs (``None`` for samples outside the shard or rejected) and the rejected samples
    as :class:`BadRow` (the cost model raises :class:`KeyeInputError` for missing/corrupt media and for
    media the processor's sizing rules refuse).
    """
    k, n = shard
    costs: list[Any | None] = [None] * len(manifest.samples)
    bad: list[BadRow] = []
    for s in manifest.samples[k::n]:
        try:
            costs[s.index] = cost_model.estimate(s)
        except KeyeInputError as err:
            bad.append(BadRow(s.line, err.reason, s.id))
    return costs, bad


def _estimate_distributed(
    manifest: Manifest, cost_model: SupportsCost, world_size: int, rank: int
) -> tuple[list[Any | None], list[BadRow]]:
    """Each rank probes/estimates 1/world of the samples, then all ranks exchange results, so a cold probe
    cache costs every rank 1/world of the work (falls back to all samples without a matching process group).
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size > 1):
        return estimate_all(manifest, cost_model)
    costs, bad = estimate_all(manifest, cost_model, shard=(rank, world_size))
    mine = ({i: c for i, c in enumerate(costs) if c is not None}, bad)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, mine)
    merged: list[Any | None] = [None] * len(manifest.samples)
    all_bad: list[BadRow] = []
    for part, part_bad in gathered:
        for i, c in part.items():
            merged[i] = c
        all_bad += part_bad
    all_bad.sort(key=lambda b: b.line)
    return merged, all_bad


def build_dataloader(
    manifest: str | os.PathLike[str] | Manifest,
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
) -> KeyeDataLoader:
    """Build the training loader for this rank.

    Args:
        manifest: JSONL path (or an already parsed :class:`Manifest`).
        processor: a :class:`keye.processing.KeyeProcessor` (or anything called as
            ``processor([messages], return_tensors="pt", for_training=True)`` returning a dict with
            ``input_ids`` [1, L] and optionally ``labels`` and media tensors).
        root: directory relative media paths are relative to (default: the manifest's directory).
        batch_tokens: token budget of one micro-batch (a packed row), or
        batch_size: average samples per micro-batch per rank; exactly one of the two.
        micro_batches: micro-batches per rank per optimizer step (gradient accumulation).
        world_size, rank: data-parallel layout (default: from ``torch.distributed`` if initialised, else 1/0).
        seed: shuffling and preprocessing seed.
        num_workers: decoding/preprocessing worker processes (0 = in this process).
        packing: ``True`` -> one packed row per micro-batch; ``False`` -> padded batch.
        pin_memory: default ``torch.cuda.is_available()``.
        group_key: manifest field (e.g. ``"group"``) whose equal values stay on one rank (RL groups).
        max_bad_fraction: fail (``KeyeInputError``) when more than this share of samples is bad.
        cost_model: default :class:`keye.data.cost.CostModel` built from ``processor``.
        probe_cache: a :class:`keye.data.probe.ProbeCache` (default: the user cache).
        bad_log: optional JSONL file receiving one line per skipped sample.

    Raises:
        KeyeInputError: unreadable manifest, or too many bad rows before training starts.
        KeyeConfigError: inconsistent batching arguments.
    """
    man = manifest if isinstance(manifest, Manifest) else read_manifest(manifest, root)
    world_size, rank = _dist_layout(world_size, rank)
    if cost_model is None:
        from keye.data.cost import CostModel

        mode = (processor_kwargs or {}).get("mode")  # the cost model must render prompts as the loader will
        cost_model = CostModel.from_processor(processor, cache=probe_cache, mode=mode)
    costs, cost_bad = _estimate_distributed(man, cost_model, world_size, rank)
    plan_bad = list(man.bad_rows) + cost_bad
    n_rows = len(man.samples) + len(man.bad_rows)
    if n_rows and len(plan_bad) / n_rows > max_bad_fraction:
        examples = "; ".join(str(b) for b in plan_bad[:5])
        raise KeyeInputError(
            f"{len(plan_bad)} of {n_rows} rows are unusable ({len(plan_bad) / n_rows:.1%} > "
            f"max_bad_fraction={max_bad_fraction:.1%}); first: {examples}",
            path=man.path,
        )
    for b in plan_bad:
        log.warning("skipping bad row: %s", b)
    excluded = [i for i, c in enumerate(costs) if c is None]
    tokens = [c.tokens if c is not None else 0 for c in costs]
    flops = [c.flops if c is not None else 0.0 for c in costs]
    groups: Sequence[object] | None = None
    if group_key is not None:
        groups = [s.row.get(group_key) for s in man.samples]
    sampler = BalancedSampler(
        tokens, flops, world_size=world_size, rank=rank, batch_size=batch_size, batch_tokens=batch_tokens,
        micro_batches=micro_batches, groups=groups, exclude=excluded, seed=seed, shuffle=shuffle, fill=fill,
        length_grouped=not packing and batch_size is not None and micro_batches > 1,
    )
    for i in sampler.too_long:
        s = man.samples[i]
        plan_bad.append(BadRow(s.line, f"sample has {tokens[i]} tokens, more than batch_tokens={batch_tokens}", s.id))
    tok = getattr(processor, "tokenizer", None)
    pad_id = getattr(tok, "pad_token_id", None)
    if pad_id is None:
        pad_id = 0
    return KeyeDataLoader(
        man,
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
    )
