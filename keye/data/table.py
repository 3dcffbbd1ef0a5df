"""The interface between the training loader and where its samples come from.

A :class:`SampleTable` is a training set seen as ``N`` numbered samples (``0..N-1``, the sampler's ids):

* ``len(table)``: the usable samples; ``table.num_rows``: every row of the source, rejected ones included
  (the denominator of the loader's bad fraction); ``table.bad_rows``: the rows rejected while reading it;
* ``table.sample(i)``: sample ``i`` as a :class:`~keye.data.manifest.Sample`, built only when asked (for an
  index, in the data-loader worker that decodes it: nothing is held per sample for the whole set);
* ``table.where(i)``: where sample ``i`` lives, for messages (``train.jsonl:17``, ``shard-003.tar:000042``);
* ``table.stored_costs(fingerprint)``: the cost columns computed when the table was built, if they were made
  for the cost model with this fingerprint, else ``None`` (the loader then estimates them, see
  :func:`estimate_costs`);
* ``table.column(key)``: one row field for every sample (RL groups), or ``None`` where a sample has none.

Costs travel as :class:`CostColumns`: numpy arrays, one entry per sample, so balancing and epoch planning
never need a Python object per sample. Two tables exist: :class:`ManifestTable` over an in-memory
:class:`~keye.data.manifest.Manifest` (the JSONL path, for small sets) and
:class:`keye.data.index.IndexTable` over a memory-mapped index made by ``keye data index``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from keye.data.manifest import BadRow, Manifest, Sample, read_manifest
from keye.errors import KeyeInputError

# The cost columns an index stores and CostColumns carries (all length N).
COST_FIELDS = ("tokens", "text_tokens", "media_tokens", "patches", "vision_flops", "llm_flops")


@runtime_checkable
class SampleTable(Protocol):
    """A training set as numbered samples whose rows are read only when asked (see the module docstring)."""

    path: Path
    bad_rows: list[BadRow]

    def __len__(self) -> int:
        """Usable samples (the sampler's ids are ``0..len-1``)."""
        ...

    @property
    def num_rows(self) -> int:
        """Rows of the source, the ones rejected while reading it included."""
        ...

    def sample(self, i: int) -> Sample:
        """Sample ``i`` (``Sample.index == i``), read and parsed now.

        Raises:
            KeyeInputError: the row can no longer be read (its shard changed or vanished), naming where it was.
        """
        ...

    def where(self, i: int) -> str:
        """``file:line`` (or ``shard:member``) of sample ``i``, for error messages."""
        ...

    def stored_costs(self, fingerprint: str) -> CostColumns | None:
        """The costs computed with the cost model of this fingerprint when the table was built, else ``None``."""
        ...

    def column(self, key: str) -> Sequence[Any]:
        """The row field ``key`` of every sample (``None`` where absent), e.g. ``"group"`` for RL groups."""
        ...


@dataclass
class CostColumns:
    """Per-sample costs as arrays of length N (``ok[i]`` False: sample ``i`` was rejected before training,
    its other entries are 0).

    Attributes:
        tokens, text_tokens, media_tokens, patches: int64 (see :class:`keye.data.cost.SampleCost`).
        vision_flops, llm_flops: float64 forward FLOPs.
        ok: bool.
        objects: the :class:`~keye.data.cost.SampleCost` objects when they were computed here (small sets);
            ``None`` for stored columns, whose ``costs[i]`` is rebuilt from the arrays (segments then hold
            one entry, the total patches).
    """

    tokens: np.ndarray
    text_tokens: np.ndarray
    media_tokens: np.ndarray
    patches: np.ndarray
    vision_flops: np.ndarray
    llm_flops: np.ndarray
    ok: np.ndarray
    objects: list[Any | None] | None = None

    @classmethod
    def empty(cls, n: int) -> CostColumns:
        """N rejected samples (every ``ok`` False), to be filled in."""
        ints = {k: np.zeros(n, np.int64) for k in ("tokens", "text_tokens", "media_tokens", "patches")}
        return cls(**ints, vision_flops=np.zeros(n), llm_flops=np.zeros(n), ok=np.zeros(n, bool))

    @classmethod
    def from_costs(cls, costs: Sequence[Any | None]) -> CostColumns:
        """From one :class:`~keye.data.cost.SampleCost` (or ``None`` for a rejected sample) per sample."""
        out = cls.empty(len(costs))
        for i, c in enumerate(costs):
            if c is not None:
                out.set(i, c)
        out.objects = list(costs)
        return out

    def set(self, i: int, cost: Any) -> None:
        """Record ``cost`` (a SampleCost) as sample ``i``'s."""
        self.tokens[i], self.text_tokens[i], self.media_tokens[i] = cost.tokens, cost.text_tokens, cost.media_tokens
        self.patches[i] = cost.patches
        self.vision_flops[i], self.llm_flops[i] = cost.vision_flops, cost.llm_flops
        self.ok[i] = True

    @property
    def flops(self) -> np.ndarray:
        """Total forward FLOPs per sample (the balancing cost)."""
        return self.vision_flops + self.llm_flops

    @property
    def excluded(self) -> np.ndarray:
        """Indices of the samples rejected before training (int64)."""
        return np.flatnonzero(~self.ok)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> Any | None:
        """Sample ``i``'s :class:`~keye.data.cost.SampleCost`, or ``None`` if it was rejected."""
        if self.objects is not None:
            return self.objects[i]
        if not self.ok[i]:
            return None
        from keye.data.cost import SampleCost

        p = int(self.patches[i])
        return SampleCost(int(self.tokens[i]), int(self.text_tokens[i]), int(self.media_tokens[i]),
                          (p,) if p else (), float(self.vision_flops[i]), float(self.llm_flops[i]))


class ManifestTable:
    """:class:`SampleTable` over an in-memory :class:`~keye.data.manifest.Manifest` (a JSONL file read whole:
    the path for small sets). Pickles with its samples (data-loader workers receive them)."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.path = manifest.path
        self.bad_rows = list(manifest.bad_rows)

    @classmethod
    def read(cls, path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> ManifestTable:
        """:func:`~keye.data.manifest.read_manifest` of ``path`` as a table."""
        return cls(read_manifest(path, root))

    def __len__(self) -> int:
        return len(self.manifest.samples)

    @property
    def num_rows(self) -> int:
        """Valid samples + rows rejected while parsing."""
        return len(self.manifest.samples) + len(self.manifest.bad_rows)

    def sample(self, i: int) -> Sample:
        """The parsed sample ``i`` (already in memory)."""
        return self.manifest.samples[i]

    def where(self, i: int) -> str:
        """``<manifest name>:<line>``."""
        return f"{self.path.name}:{self.manifest.samples[i].line}"

    def stored_costs(self, fingerprint: str) -> CostColumns | None:
        """Always ``None``: a JSONL manifest carries no costs."""
        return None

    def column(self, key: str) -> list[Any]:
        """``row[key]`` of every sample (``None`` where absent)."""
        return [s.row.get(key) for s in self.manifest.samples]


def cost_fingerprint(cost_model: Any) -> str:
    """A short hash of everything a :class:`keye.data.cost.CostModel`'s numbers depend on: its class, the
    processor's variant, tokenizer (vocabulary size and the ids of a probe text), chat template, image/video
    configuration, the thinking mode and the model dimensions. Equal fingerprints give equal costs, so an
    index's stored costs are used only under the fingerprint they were made with."""
    import hashlib
    import json
    from dataclasses import asdict, is_dataclass

    proc = cost_model.processor
    tok = proc.tokenizer
    probe = "Keye-VL 视频 0.5 s <think>\n</think> 12:34 The answer is (B)."
    template = proc.chat_template
    parts = {
        "class": getattr(cost_model, "fingerprint_name", f"{type(cost_model).__module__}.{type(cost_model).__qualname__}"),
        "variant": getattr(cost_model, "variant", None),
        "mode": getattr(cost_model, "mode", None),
        "slowfast_exact": getattr(cost_model, "slowfast_exact", None),
        "dims": asdict(cost_model.dims) if is_dataclass(getattr(cost_model, "dims", None)) else None,
        "image": repr(proc.image_processor.config),
        "template": getattr(template, "source", repr(template)),
        "vocab": len(tok) if hasattr(tok, "__len__") else None,
        "probe": list(tok(probe, add_special_tokens=False)["input_ids"]),
    }
    blob = json.dumps(parts, sort_keys=True, default=repr).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


def open_table(source: str | os.PathLike[str] | Manifest | SampleTable,
               root: str | os.PathLike[str] | None = None) -> SampleTable:
    """The table for what :func:`keye.data.loader.build_dataloader` accepts: an index directory (made by
    ``keye data index``), a JSONL manifest path, a parsed :class:`Manifest`, or a table (returned as is).

    Raises:
        KeyeInputError: the path does not exist, or is a folder that is not an index.
    """
    if isinstance(source, Manifest):
        return ManifestTable(source)
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            from keye.data.index import IndexTable, is_index

            if not is_index(p):
                raise KeyeInputError(
                    "folder is not a keye index (no index.json); build one with 'keye data index SOURCES --out DIR'",
                    path=p)
            return IndexTable(p)
        return ManifestTable.read(p, root)
    if isinstance(source, SampleTable):
        return source
    raise KeyeInputError(f"cannot read a training set from a {type(source).__name__}")


def has_multi_answer_rows(table: SampleTable) -> bool:
    """True when a sample of ``table`` is a multi-answer row (an index answers from its ``answers`` column
    without reading rows)."""
    numeric = getattr(table, "numeric", None)
    if numeric is not None:
        return bool((numeric("answers") > 0).any())
    return any(table.sample(i).answers is not None for i in range(len(table)))


def estimate_costs(table: SampleTable, cost_model: Any, *, shard: tuple[int, int] = (0, 1),
                   progress: bool = False) -> tuple[CostColumns, list[BadRow]]:
    """Run ``cost_model`` (a :class:`keye.data.cost.CostModel` or anything with ``estimate(sample)``) over
    the samples ``i`` with ``i % n == k`` (``shard=(k, n)``), reading them one at a time.

    Returns the cost columns (entries outside the shard or rejected: ``ok`` False) and the rejected samples
    as :class:`BadRow` (missing / corrupt media, sizing rules; the cost model raises
    :class:`KeyeInputError`). A table with in-memory samples keeps the cost objects (``objects``).
    """
    k, n = shard
    cols = CostColumns.empty(len(table))
    keep = isinstance(table, ManifestTable)
    objs: list[Any | None] = [None] * len(table) if keep else []
    bad: list[BadRow] = []
    idx = range(k, len(table), n)
    if progress:
        from tqdm.auto import tqdm

        idx = tqdm(idx, desc="estimating costs", unit="sample")
    for i in idx:
        s = table.sample(i)
        try:
            c = cost_model.estimate(s)
        except KeyeInputError as err:
            bad.append(BadRow(s.line, err.reason, s.id))
            continue
        cols.set(i, c)
        if keep:
            objs[i] = c
    if keep:
        cols.objects = objs
    return cols, bad


def merge_costs(parts: Sequence[CostColumns]) -> CostColumns:
    """One column set from disjoint shards of the same table (each sample ``ok`` in at most one part)."""
    out = CostColumns.empty(len(parts[0]))
    objs: list[Any | None] | None = [None] * len(out) if all(p.objects is not None for p in parts) else None
    for p in parts:
        m = p.ok
        for name in (*COST_FIELDS, "ok"):
            getattr(out, name)[m] = getattr(p, name)[m]
        if objs is not None:
            for i in np.flatnonzero(m):
                objs[i] = p.objects[i]
    out.objects = objs
    return out
