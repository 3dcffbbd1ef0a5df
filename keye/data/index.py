"""A training set of any size as a compact, memory-mapped index: ``keye data index SOURCES --out DIR``.

The index is a folder::

    DIR/index.json          version, the cost fingerprint, and one entry per shard (its source, key, counts)
    DIR/shards/NNNNN.arrow  one Arrow IPC file per source shard, memory-mapped when read
    DIR/shards/NNNNN.bad.jsonl   the shard's rejected rows (line, id, reason)
    DIR/media/              media extracted from WebDataset tars / copied from non-local file systems

Each ``.arrow`` file has one row per usable sample: ``id``, ``line`` (line of a JSONL file, row of a Parquet
file or saved dataset, sample of a tar), where the conversation lives (``offset`` / ``length`` in a local
JSONL file, else the row itself as JSON in ``row``), its media (``media``: the paths, tab-separated), and the
cost columns: the loader's exact ``tokens``, ``text_tokens``, ``media_tokens``, vision ``patches``,
``vision_flops``, ``llm_flops`` (:class:`keye.data.cost.CostModel` with the processor given to
``keye data index``), and the probed ``images``, ``videos``, ``frames`` (frames in the video files),
``width`` / ``height`` (of the first media), ``duration`` (seconds of video) and ``bytes`` (media file sizes);
``group`` and ``answers`` (multi-answer count) too. Costs are stored under their :func:`cost_fingerprint`; a
loader with another processor or thinking mode estimates them again.

Building parses and probes rows in worker processes (a :class:`~keye.data.probe.ProbeCache` shared on disk
makes a re-run cheap), writes each shard as soon as its rows are done and records it in ``index.json``, so an
interrupted build resumes with the shards it had not finished; re-running with more sources (or a folder that
gained files) indexes only the new or changed shards. Bad rows are counted and listed, never fatal; a shard
that cannot be read at all is reported with its name and skipped (and tried again on the next run).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from keye.data.manifest import BadRow, Sample, estimate_cost, parse_row
from keye.data.sources import Chunk, Shard, expand_sources, read_chunk, shard_chunks
from keye.data.table import COST_FIELDS, CostColumns, cost_fingerprint
from keye.errors import KeyeConfigError, KeyeInputError

INDEX_VERSION = 1
INDEX_FILE = "index.json"
_PROBE_FIELDS = ("images", "videos", "frames", "width", "height", "duration", "bytes", "answers")
# tree_tokens / tree_llm_flops: a multi-answer row as one prefix tree (keye data check's count), else = tokens.
_PROBE_FIELDS += ("tree_tokens", "tree_llm_flops")
_COLUMNS = ("id", "line", "offset", "length", "row", "media", "group", *COST_FIELDS, *_PROBE_FIELDS)
_INT_FIELDS = ("tree_tokens", "tokens", "text_tokens", "media_tokens", "patches", "images", "videos", "frames", "width", "height",
               "bytes", "answers")


def is_index(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a folder made by :func:`build_index`."""
    return (Path(path) / INDEX_FILE).is_file()


# ------------------------------------------------------------------------------------------ building


class _MemoCache:
    """A :class:`~keye.data.probe.ProbeCache` with a small in-process memo in front: the cost model asks about
    the same file several times per sample and sets often reuse a file; keys carry mtime and size, so a memo
    entry is never stale."""

    def __init__(self, cache: Any, size: int = 4096):
        self.cache, self.size, self.memo = cache, size, {}

    def get(self, key: str) -> Any:
        """The cached value (memo first)."""
        if key in self.memo:
            return self.memo[key]
        v = self.cache.get(key)
        if v is not None:
            self._keep(key, v)
        return v

    def put(self, key: str, value: Any) -> None:
        """Store in both."""
        self.cache.put(key, value)
        self._keep(key, value)

    def _keep(self, key: str, value: Any) -> None:
        if len(self.memo) >= self.size:
            self.memo.clear()
        self.memo[key] = value


def _batch_cost_model_class() -> type:
    from keye.data.cost import CostModel
    from keye.data.probe import ProbeCache

    class _BatchCostModel(CostModel):
        """:class:`~keye.data.cost.CostModel` with the same numbers, faster over many rows: :meth:`prepare`
        renders a chunk's conversations and tokenises all their distinct text pieces in one tokenizer call, and
        each media file's tokens are remembered (keyed by path, mtime, size and the item's options), since sets
        reuse files and the cost model works them out from the same probe each time. Its fingerprint is
        CostModel's (the tests check the numbers equal)."""

        fingerprint_name = f"{CostModel.__module__}.{CostModel.__qualname__}"
        _MEMO = 8192

        def __init__(self, *a: Any, **kw: Any):
            super().__init__(*a, **kw)
            self._pieces: dict[int, tuple[list[str], list[str]]] = {}
            self._counts: dict[str, int] = {}
            self._media: dict[tuple[Any, ...], tuple[int, list[int]]] = {}

        def prepare(self, samples: list[Sample]) -> None:
            """Render and tokenise the text of ``samples`` (kept alive by the caller until :meth:`release`)."""
            todo: set[str] = set()
            for s in samples:
                try:
                    pieces = super().text_pieces(s.messages)
                except Exception:  # noqa: BLE001 - estimate() raises it again, with the row's context
                    continue
                self._pieces[id(s.messages)] = pieces
                todo.update(p for p in pieces[0] if p and p not in self._counts)
            if len(self._counts) + len(todo) > 50 * self._MEMO:
                self._counts.clear()
            texts = sorted(todo)
            if not texts:
                return
            tok = self.processor.tokenizer
            backend = getattr(tok, "backend_tokenizer", None)  # a fast tokenizer's Rust core, without the
            try:  # per-text Python wrapping of transformers' __call__ (the same ids)
                if backend is not None:
                    counts = [len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False)]
                else:
                    counts = [len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]
            except (TypeError, AttributeError):  # a tokenizer without batch calls: one at a time, as before
                return
            if len(counts) == len(texts):
                self._counts.update(zip(texts, counts))

        def release(self) -> None:
            """Forget the prepared conversations (their ids may be reused)."""
            self._pieces.clear()

        def text_pieces(self, messages: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
            hit = self._pieces.get(id(messages))
            return hit if hit is not None else super().text_pieces(messages)

        def _n_text(self, text: str) -> int:
            n = self._counts.get(text)
            return n if n is not None else super()._n_text(text)

        def _memo(self, ref: Any, fn: Any) -> tuple[int, list[int]]:
            stat = ProbeCache.file_key("m", ref.path)
            if stat is None:
                return fn(ref)
            key = (fn.__name__, stat, ref.frames, repr(sorted(ref.options.items())))
            hit = self._media.get(key)
            if hit is None:
                if len(self._media) >= self._MEMO:
                    self._media.clear()
                hit = self._media[key] = fn(ref)
            return hit[0], list(hit[1])

        def image_tokens(self, ref: Any) -> tuple[int, list[int]]:
            return self._memo(ref, super().image_tokens)

        def video_tokens(self, ref: Any) -> tuple[int, list[int]]:
            return self._memo(ref, super().video_tokens)

    return _BatchCostModel


@dataclass
class _Context:
    """What a worker needs: the cost model (with the memo cache), the media folder, each shard's root."""

    cost_model: Any
    media_dir: Path
    roots: dict[int, str]


_CTX: _Context | None = None


def _make_cost_model(processor: Any, mode: str | None, cache_path: str | None) -> Any:
    from keye.data.manifest import _approx_processor
    from keye.data.probe import ProbeCache

    if processor is None:
        processor = _approx_processor()
    elif isinstance(processor, (str, os.PathLike)):
        from keye.processing.processor import KeyeProcessor

        processor = KeyeProcessor.from_pretrained(processor)
    return _batch_cost_model_class()(processor, cache=_MemoCache(ProbeCache(cache_path)), mode=mode)


def _init_worker(processor: Any, mode: str | None, cache_path: str | None, media_dir: str,
                 roots: dict[int, str]) -> None:
    global _CTX
    _CTX = _Context(_make_cost_model(processor, mode, cache_path), Path(media_dir), roots)


@dataclass
class _ChunkResult:
    """The usable rows of one chunk as columns, and its bad rows (or the shard's error)."""

    shard: int
    cols: dict[str, list[Any]] = field(default_factory=dict)
    bad: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    rows: int = 0


def _row_costs(ctx: _Context, sample: Sample) -> dict[str, Any]:
    """Costs and probed media figures of one parsed sample (raises KeyeInputError when unusable)."""
    from keye.data.probe import probe_media

    c = ctx.cost_model.estimate(sample)
    out = {"tokens": c.tokens, "text_tokens": c.text_tokens, "media_tokens": c.media_tokens, "patches": c.patches,
           "vision_flops": c.vision_flops, "llm_flops": c.llm_flops, "images": 0, "videos": 0, "frames": 0,
           "width": 0, "height": 0, "duration": 0.0, "bytes": 0, "answers": len(sample.answers or ()),
           "tree_tokens": c.tokens, "tree_llm_flops": c.llm_flops}
    if sample.answers is not None:
        tree = estimate_cost(ctx.cost_model, sample)
        out["tree_tokens"], out["tree_llm_flops"] = tree.tokens, tree.llm_flops
    for ref in sample.media:
        info = probe_media(ref, ctx.cost_model.cache)
        out["images" if ref.kind == "image" else "videos"] += 1
        if ref.kind == "video":
            out["frames"] += info.num_frames
            out["duration"] += info.duration
        if not out["width"]:
            out["width"], out["height"] = info.width, info.height
        for f in ref.frames or (ref.path,):
            out["bytes"] += os.path.getsize(f)
    return out


def _process_chunk(chunk: Chunk) -> _ChunkResult:
    """Parse, probe and cost every row of ``chunk`` (in a worker process): the rows are parsed first so the
    chunk's text is tokenised in one batch (see :class:`_BatchCostModel`)."""
    ctx = _CTX
    assert ctx is not None, "worker not initialised"
    res = _ChunkResult(chunk.shard)
    root = ctx.roots[chunk.shard]
    local_root = Path(root) if "://" not in root else Path("/")
    keep_row = not (chunk.kind == "jsonl" and "://" not in chunk.uri)
    parsed: list[tuple[Sample, int, int]] = []
    try:
        for line, obj, offset, length in read_chunk(chunk, ctx.media_dir, root):
            res.rows += 1
            sid = obj.get("id") if isinstance(obj, dict) else None
            sid = None if sid is None else str(sid)
            try:
                if isinstance(obj, ValueError):
                    raise obj
                messages, media = parse_row(obj, local_root)
            except ValueError as err:
                res.bad.append({"line": line, "id": sid, "reason": str(err)})
                continue
            parsed.append((Sample(0, line, sid if sid is not None else f"line-{line}", messages, media, obj),
                           offset, length))
    except KeyeInputError as err:
        res.error = err.reason
        return res
    cols: dict[str, list[Any]] = {k: [] for k in _COLUMNS}
    prepare = getattr(ctx.cost_model, "prepare", None)
    if prepare is not None:
        prepare([p[0] for p in parsed])
    for sample, offset, length in parsed:
        try:
            vals = _row_costs(ctx, sample)
        except KeyeInputError as err:
            res.bad.append({"line": sample.line, "id": sample.id, "reason": err.reason})
            continue
        obj = sample.row
        cols["id"].append(sample.id)
        cols["line"].append(sample.line)
        cols["offset"].append(offset)
        cols["length"].append(length)
        cols["row"].append(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) if keep_row else None)
        cols["media"].append("\t".join(m.path for m in sample.media))
        g = obj.get("group")
        cols["group"].append(None if g is None else str(g))
        for k, v in vals.items():
            cols[k].append(v)
    if prepare is not None:
        ctx.cost_model.release()
    res.bad.sort(key=lambda b: b["line"])
    res.cols = cols
    return res


def _arrow_table(cols: dict[str, list[Any]]) -> Any:
    import pyarrow as pa

    arrays = {
        "id": pa.array(cols["id"], pa.string()),
        "line": pa.array(cols["line"], pa.int64()),
        "offset": pa.array(cols["offset"], pa.int64()),
        "length": pa.array(cols["length"], pa.int64()),
        "row": pa.array(cols["row"], pa.large_string()),
        "media": pa.array(cols["media"], pa.large_string()),
        "group": pa.array(cols["group"], pa.string()),
    }
    for k in (*COST_FIELDS, *_PROBE_FIELDS):
        arrays[k] = pa.array(cols[k], pa.int64() if k in _INT_FIELDS else pa.float64())
    return pa.table(arrays)


def _write_ipc(path: Path, table: Any) -> None:
    import pyarrow as pa

    tmp = path.with_name(path.name + ".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=1 << 16)
    os.replace(tmp, path)


@dataclass
class IndexReport:
    """What one :func:`build_index` run did.

    Attributes:
        out: the index folder.
        shards: shards in the index after the run; ``indexed``: the ones (re)indexed by this run;
            ``skipped``: already indexed and unchanged.
        samples: usable samples in the index; ``bad``: rejected rows in the index (every shard).
        new_samples, new_bad: of the shards indexed by this run.
        bad_shards: ``(shard, reason)`` of each shard that could not be read (skipped, retried next run).
        bad_examples: a few of this run's bad rows, as ``shard:line (id): reason``.
    """

    out: Path
    shards: int
    indexed: int
    skipped: int
    samples: int
    bad: int
    new_samples: int
    new_bad: int
    bad_shards: list[tuple[str, str]]
    bad_examples: list[str]

    def format(self) -> str:
        """A few human-readable lines."""
        lines = [f"index {self.out}: {self.samples:,} samples in {self.shards} shard(s), {self.bad:,} bad rows",
                 f"this run: {self.indexed} shard(s) indexed ({self.new_samples:,} samples, {self.new_bad:,} bad "
                 f"rows), {self.skipped} unchanged shard(s) skipped"]
        lines += [f"bad row: {b}" for b in self.bad_examples]
        lines += [f"bad shard (skipped): {s}: {r}" for s, r in self.bad_shards]
        return "\n".join(lines)


def _load_meta(out: Path, fingerprint: str) -> dict[str, Any]:
    meta_path = out / INDEX_FILE
    if not meta_path.is_file():
        return {"version": INDEX_VERSION, "fingerprint": fingerprint, "shards": []}
    meta = json.loads(meta_path.read_text())
    if meta.get("version") != INDEX_VERSION:
        raise KeyeConfigError(f"{meta_path}: index version {meta.get('version')} != {INDEX_VERSION}; build a new index")
    if meta["fingerprint"] != fingerprint:
        raise KeyeConfigError(
            f"{meta_path}: this index's costs were made with another processor or thinking mode; give the same "
            "--processor / --mode, or build a new index in another folder")
    return meta


def _save_meta(out: Path, meta: dict[str, Any]) -> None:
    tmp = out / (INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / INDEX_FILE)


def build_index(
    sources: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    *,
    processor: Any = None,
    mode: str | None = None,
    root: str | os.PathLike[str] | None = None,
    workers: int | None = None,
    cache: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> IndexReport:
    """Index ``sources`` into the folder ``out`` (created; an existing index there is extended).

    Args:
        sources: files, folders, globs, saved ``datasets`` folders or fsspec URLs (see
            :func:`keye.data.sources.expand_sources`).
        processor: the :class:`~keye.processing.processor.KeyeProcessor` (or its folder) the loader will use, so
            the stored costs are the loader's; ``None``: the approximate stand-in of ``keye data check`` (the
            loader then estimates costs itself).
        mode: the thinking mode the loader's processor renders with (``data.processor_kwargs.mode``).
        root: the folder relative media paths are relative to (default: each shard's folder).
        workers: processes parsing and probing rows (default: all CPUs; 0 = in this process).
        cache: the probe cache file (default ``~/.cache/keye/probe.sqlite``).
        progress: show a progress bar.

    Returns:
        :class:`IndexReport`. Bad rows and unreadable shards are reported, never raised.

    Raises:
        KeyeInputError: a source that does not exist or has an unknown type.
        KeyeConfigError: ``out`` holds an index built with another processor / mode.
    """
    out = Path(out)
    fingerprint = cost_fingerprint(_make_cost_model(processor, mode, None if cache is None else str(cache)))
    shards = expand_sources([str(s) for s in sources], None if root is None else str(root))
    (out / "shards").mkdir(parents=True, exist_ok=True)
    meta = _load_meta(out, fingerprint)
    meta["fingerprint"] = fingerprint
    entries: dict[str, dict[str, Any]] = {e["uri"]: e for e in meta["shards"]}
    todo: list[tuple[Shard, int]] = []
    next_no = max((e["number"] for e in meta["shards"]), default=-1) + 1
    skipped = 0
    for s in shards:
        e = entries.get(s.uri)
        if e is not None and e["key"] == s.key and e["root"] == s.root:
            skipped += 1
            continue
        if e is None:
            e = {"uri": s.uri, "number": next_no}
            next_no += 1
            meta["shards"].append(e)
            entries[s.uri] = e
        e.update(kind=s.kind, root=s.root, key=None, rows=0, bad=0)  # key set once its rows are written
        todo.append((s, e["number"]))
    bad_shards: list[tuple[str, str]] = []
    chunks: list[Chunk] = []
    for s, number in todo:
        try:
            chunks += shard_chunks(s, number) or [Chunk(number, s.uri, "empty")]  # an empty shard is indexed too
        except KeyeInputError as err:
            bad_shards.append((s.uri, err.reason))
    _, _, examples = _run_chunks(out, meta, entries, todo, chunks, bad_shards, processor, mode,
                                                 cache, workers, progress)
    meta["shards"] = [e for e in meta["shards"] if e.get("key") is not None]
    meta["bad_shards"] = [{"uri": u, "reason": r} for u, r in bad_shards]
    _save_meta(out, meta)
    _check_duplicates(out, meta)
    meta = json.loads((out / INDEX_FILE).read_text())
    done = {s.uri for s, _ in todo}
    new = [e for e in meta["shards"] if e["uri"] in done]  # counted after duplicate ids were moved to bad rows
    return IndexReport(out, len(meta["shards"]), len(todo) - len(bad_shards), skipped,
                       sum(e["rows"] for e in meta["shards"]), sum(e["bad"] for e in meta["shards"]),
                       sum(e["rows"] for e in new), sum(e["bad"] for e in new), bad_shards, examples)


def _chunk_results(chunks: list[Chunk], processor: Any, mode: str | None, cache: Any, workers: int | None,
                   out: Path, roots: dict[int, str]) -> Iterator[_ChunkResult]:
    args = (processor, mode, None if cache is None else str(cache), str(out / "media"), roots)
    n = (os.cpu_count() or 1) if workers is None else workers
    if n <= 0 or len(chunks) <= 1:
        _init_worker(*args)
        yield from map(_process_chunk, chunks)
        return
    import multiprocessing as mp

    with mp.get_context("fork" if os.name == "posix" else "spawn").Pool(min(n, len(chunks)), _init_worker,
                                                                           args) as pool:
        yield from pool.imap(_process_chunk, chunks)


class _ShardWriter:
    """Writes one shard's Arrow file chunk by chunk (nothing of a whole shard is held in memory) and its bad
    rows; :meth:`commit` renames it into place, :meth:`abort` removes it."""

    def __init__(self, out: Path, number: int):
        import pyarrow as pa

        self.path = out / "shards" / f"{number:05d}.arrow"
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.bad_path = self.path.with_name(f"{number:05d}.bad.jsonl")
        self.sink = pa.OSFile(str(self.tmp), "wb")
        self.writer: Any = None
        self.bad: list[dict[str, Any]] = []
        self.rows = 0

    def add(self, res: _ChunkResult) -> None:
        """Append one chunk's rows and bad rows."""
        import pyarrow as pa

        t = _arrow_table(res.cols)
        if self.writer is None:
            self.writer = pa.ipc.new_file(self.sink, t.schema)
        self.writer.write_table(t, max_chunksize=1 << 16)
        self.rows += t.num_rows
        self.bad += res.bad

    def commit(self) -> None:
        """Close and move the shard into place, with its bad-row list."""
        if self.writer is None:
            self.add(_ChunkResult(0, {k: [] for k in _COLUMNS}))
        self.writer.close()
        self.sink.close()
        os.replace(self.tmp, self.path)
        with open(self.bad_path, "w", encoding="utf-8") as f:
            for b in self.bad:
                f.write(json.dumps(b) + "\n")

    def abort(self) -> None:
        """Drop the partial file."""
        if self.writer is not None:
            self.writer.close()
        self.sink.close()
        self.tmp.unlink(missing_ok=True)


def _run_chunks(out: Path, meta: dict[str, Any], entries: dict[str, dict[str, Any]], todo: list[tuple[Shard, int]],
                chunks: list[Chunk], bad_shards: list[tuple[str, str]], processor: Any, mode: str | None,
                cache: Any, workers: int | None, progress: bool) -> tuple[int, int, list[str]]:
    """Run the chunks in order (a shard's chunks are consecutive); write each shard as its chunks come in and
    record it in index.json once its last chunk is written."""
    from tqdm.auto import tqdm

    by_no = {no: s for s, no in todo}
    remaining: dict[int, int] = {}
    for c in chunks:
        remaining[c.shard] = remaining.get(c.shard, 0) + 1
    new_samples = new_bad = 0
    examples: list[str] = []
    bar = tqdm(total=len(chunks), desc="indexing", unit="chunk", disable=not progress)
    roots = {no: s.root for s, no in todo}
    writer: _ShardWriter | None = None
    failed: dict[int, str] = {}
    for res in _chunk_results(chunks, processor, mode, cache, workers, out, roots):
        bar.update(1)
        remaining[res.shard] -= 1
        if res.error is not None and res.shard not in failed:
            failed[res.shard] = res.error
        if res.shard not in failed:
            writer = writer or _ShardWriter(out, res.shard)
            writer.add(res)
        if remaining[res.shard]:
            continue
        shard = by_no[res.shard]
        if res.shard in failed:
            if writer is not None:
                writer.abort()
            writer = None
            bad_shards.append((shard.uri, failed[res.shard]))
            continue
        assert writer is not None
        writer.commit()
        entries[shard.uri].update(key=shard.key, rows=writer.rows, bad=len(writer.bad))
        new_samples += writer.rows
        new_bad += len(writer.bad)
        examples += [f"{shard.name}:{b['line']}{' (' + b['id'] + ')' if b['id'] else ''}: {b['reason']}"
                     for b in writer.bad[: max(0, 5 - len(examples))]]
        writer = None
        bar.set_postfix(samples=new_samples, bad=new_bad)
        _save_meta(out, {**meta, "shards": [e for e in meta["shards"] if e.get("key") is not None]})
    bar.close()
    return new_samples, new_bad, examples


def _check_duplicates(out: Path, meta: dict[str, Any]) -> None:
    """Ids must be unique across the index (resume and evaluation name samples by id): a later duplicate is
    moved to its shard's bad rows ("duplicate id"), the first occurrence kept. Counted in Arrow, without a Python
    object per sample."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not meta["shards"]:
        return
    ids = pa.chunked_array([c for e in meta["shards"]
                            for c in _open_ipc(out / "shards" / f"{e['number']:05d}.arrow").column("id").chunks],
                           pa.string())
    counts = pc.value_counts(ids)
    dups = counts.field("values").filter(pc.greater(counts.field("counts"), 1))
    if len(dups) == 0:
        return
    first: dict[str, tuple[int, int]] = {}  # id -> (shard number, line) of its first occurrence
    for e in meta["shards"]:
        path = out / "shards" / f"{e['number']:05d}.arrow"
        t = _open_ipc(path)
        hit = pc.is_in(t.column("id"), value_set=dups).to_numpy(zero_copy_only=False)
        drop = np.zeros(len(hit), bool)
        reasons = []
        for j in np.flatnonzero(hit):
            sid, line = t.column("id")[int(j)].as_py(), t.column("line")[int(j)].as_py()
            if sid in first:
                drop[j] = True
                no, at = first[sid]
                name = next(x["uri"] for x in meta["shards"] if x["number"] == no).rsplit("/", 1)[-1]
                where = f"line {at}" if no == e["number"] else f"{name}:{at}"
                reasons.append({"line": line, "id": sid, "reason": f"duplicate id {sid!r} (first on {where})"})
            else:
                first[sid] = (e["number"], line)
        if not drop.any():
            continue
        with open(out / "shards" / f"{e['number']:05d}.bad.jsonl", "a", encoding="utf-8") as f:
            for r in reasons:
                f.write(json.dumps(r) + "\n")
        kept = t.filter(pa.array(~drop)).combine_chunks()
        del t
        _write_ipc(path, kept)
        e["rows"], e["bad"] = kept.num_rows, e["bad"] + int(drop.sum())
    _save_meta(out, meta)


# ------------------------------------------------------------------------------------------ reading


def _open_ipc(path: Path) -> Any:
    import pyarrow as pa

    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


class IndexTable:
    """:class:`~keye.data.table.SampleTable` over an index folder: the shards' Arrow files are memory-mapped
    (pages are read when touched, and shared by the processes of a machine), a sample's row is read and parsed
    only by :meth:`sample`, and the cost columns are read on demand. Pickles as its folder (each data-loader
    worker maps the files itself).

    Raises:
        KeyeInputError: the folder is not an index or a shard file is missing.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        meta_path = self.path / INDEX_FILE
        if not meta_path.is_file():
            raise KeyeInputError("not a keye index (no index.json)", path=self.path)
        self.meta = json.loads(meta_path.read_text())
        self.shards = self.meta["shards"]
        self.fingerprint = self.meta["fingerprint"]
        counts = np.array([e["rows"] for e in self.shards], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self._tables: dict[int, Any] = {}
        self._bad: list[BadRow] | None = None
        self._files: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_rows(self) -> int:
        """Usable samples + rejected rows of every shard."""
        return len(self) + sum(e["bad"] for e in self.shards)

    @property
    def bad_rows(self) -> list[BadRow]:
        """Every row rejected while indexing (``line`` is the line in its shard, named in the id)."""
        if self._bad is None:
            self._bad = []
            for e in self.shards:
                name = e["uri"].rstrip("/").rsplit("/", 1)[-1]
                with open(self.path / "shards" / f"{e['number']:05d}.bad.jsonl", encoding="utf-8") as f:
                    for text in f:
                        b = json.loads(text)
                        self._bad.append(BadRow(b["line"], f"{name}: {b['reason']}", b["id"]))
        return self._bad

    def _table(self, k: int) -> Any:
        t = self._tables.get(k)
        if t is None:
            path = self.path / "shards" / f"{self.shards[k]['number']:05d}.arrow"
            if not path.is_file():
                raise KeyeInputError("index shard file missing; rebuild the index", path=path)
            t = self._tables[k] = _open_ipc(path)
        return t

    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} is not in this index of {len(self)} samples")
        k = int(np.searchsorted(self.starts, i, side="right") - 1)
        return k, i - int(self.starts[k])

    def _value(self, k: int, j: int, name: str) -> Any:
        return self._table(k).column(name)[j].as_py()

    def where(self, i: int) -> str:
        """``<shard file>:<line>`` of sample ``i``."""
        k, j = self._locate(i)
        return f"{self.shards[k]['uri'].rstrip('/').rsplit('/', 1)[-1]}:{self._value(k, j, 'line')}"

    def _read_line(self, uri: str, offset: int, length: int) -> bytes:
        f = self._files.get(uri)
        if f is None or getattr(f, "_pid", None) != os.getpid():
            f = open(uri, "rb")  # noqa: SIM115 - kept open: one handle per shard per process
            f._pid = os.getpid()  # type: ignore[attr-defined]
            self._files[uri] = f
        f.seek(offset)
        return f.read(length)

    def sample(self, i: int) -> Sample:
        """Sample ``i``, read from its shard (JSONL: by offset) or from the index, and parsed now.

        Raises:
            KeyeInputError: the JSONL shard changed since it was indexed (its row at the offset is not the
                same sample), naming the file and line.
        """
        k, j = self._locate(i)
        e = self.shards[k]
        t = self._table(k)
        line, sid = t.column("line")[j].as_py(), t.column("id")[j].as_py()
        text = t.column("row")[j].as_py()
        try:
            if text is None:
                raw = self._read_line(e["uri"], t.column("offset")[j].as_py(), t.column("length")[j].as_py())
                obj = json.loads(raw)
            else:
                obj = json.loads(text)
            if str(obj.get("id", f"line-{line}")) != sid:
                raise ValueError(f"the row there is not sample {sid!r}")
            messages, media = parse_row(obj, Path(e["root"]) if "://" not in e["root"] else Path("/"))
        except (OSError, ValueError, AttributeError) as err:
            raise KeyeInputError(f"{self.where(i)} changed since it was indexed ({err}); re-run keye data index",
                                 path=e["uri"]) from err
        return Sample(i, line, sid, messages, media, obj)

    def column(self, key: str) -> Sequence[Any]:
        """A stored column (``group``, ``id``, ``duration``, ...) for every sample, or ``row[key]`` read from
        every row for other keys (a full pass over the set)."""
        if self.shards and key in self._table(0).column_names:
            return [v for k in range(len(self.shards)) for v in self._table(k).column(key).to_pylist()]
        return [self.sample(i).row.get(key) for i in range(len(self))]

    def numeric(self, name: str) -> np.ndarray:
        """A numeric column (a cost or probe field) of every sample as one numpy array."""
        import pyarrow as pa

        out = np.empty(len(self), np.int64 if name in _INT_FIELDS else np.float64)
        pos = 0
        for e in self.shards:
            # A mapping of its own, closed at once: the pages read stay out of this process's resident set.
            src = pa.memory_map(str(self.path / "shards" / f"{e['number']:05d}.arrow"), "r")
            try:
                reader = pa.ipc.open_file(src)
                for b in range(reader.num_record_batches):
                    chunk = reader.get_batch(b).column(name)  # a zero-copy view of the file, copied once
                    out[pos:pos + len(chunk)] = chunk.to_numpy(zero_copy_only=False)
                    pos += len(chunk)
                    del chunk
                del reader
            finally:
                src.close()
        return out

    def stored_costs(self, fingerprint: str) -> CostColumns | None:
        """The stored cost columns when they were made under ``fingerprint``, else ``None``."""
        if fingerprint != self.fingerprint:
            return None
        cols = {k: self.numeric(k) for k in COST_FIELDS}
        return CostColumns(**cols, ok=np.ones(len(self), bool))
