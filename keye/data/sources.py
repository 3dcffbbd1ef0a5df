"""Where training rows come from: JSONL files, folders / globs of shards, Parquet, WebDataset tars, Hugging Face
datasets saved to disk, and fsspec URLs; each cut into chunks that worker processes read independently.

:func:`expand_sources` turns what a user passes to ``keye data index`` into :class:`Shard` s (one per file, or
one per saved dataset folder) and :func:`shard_chunks` cuts a shard into :class:`Chunk` s (byte ranges of a
JSONL file, row groups of a Parquet file, row ranges of a saved dataset, a whole tar). :func:`read_chunk`
yields the chunk's rows as ``(line, row object or error, offset, length)``: the same sample gives the same row
whichever form it came from (Arrow's null-filled struct fields are dropped, a ``messages`` column stored as a
JSON string is decoded).

Media paths: a relative path is relative to the directory holding the shard file (a saved dataset folder
counts as one file) or to ``root`` when given. WebDataset tars carry their media: a media value naming a
member of the same sample (``000001.mp4``, or just its extension ``mp4``) is extracted once into the index's
``media/`` folder. Sources on a non-local fsspec file system (``s3://``, ``memory://``, ...) have their
relative media copied there too, since decoders read local files.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import json
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keye.data.manifest import MEDIA_TYPES
from keye.errors import KeyeInputError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
SHARD_SUFFIXES = (*JSONL_SUFFIXES, ".parquet", ".tar")
CHUNK_ROWS = 4096  # rows a worker reads at once (small enough for a smooth progress bar)
_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class Shard:
    """One source file (or saved dataset folder).

    Attributes:
        uri: as given / found (a local path, or an fsspec URL for a non-local file system).
        kind: ``"jsonl"``, ``"parquet"``, ``"tar"`` or ``"hf"`` (a ``datasets`` folder).
        root: the directory (or URL) relative media paths are joined to.
        key: size and modification time (or ETag): a shard whose key changed is indexed again.
    """

    uri: str
    kind: str
    root: str
    key: str

    @property
    def local(self) -> bool:
        """True for a file on this machine (read by offset; its media paths are used where they are)."""
        return "://" not in self.uri

    @property
    def name(self) -> str:
        """The file name, for messages."""
        return self.uri.rstrip("/").rsplit("/", 1)[-1]


@dataclass(frozen=True)
class Chunk:
    """A piece of a shard one worker reads: ``start``/``stop`` are byte offsets (JSONL), row numbers (saved
    dataset), a row group (Parquet: ``start``) or unused (tar); ``first_line`` is the 1-based line / row number
    of its first row."""

    shard: int
    uri: str
    kind: str
    start: int = 0
    stop: int = 0
    first_line: int = 1


def _kind_of(name: str) -> str | None:
    low = name.lower()
    if low.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if low.endswith(".parquet"):
        return "parquet"
    if low.endswith(".tar"):
        return "tar"
    return None


def _is_hf_dir(p: Path) -> bool:
    return (p / "state.json").is_file() and (p / "dataset_info.json").is_file()


def _local_key(p: Path) -> str:
    if p.is_dir():  # a saved dataset: its arrow files decide
        parts = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in p.iterdir() if f.is_file())
        return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]
    st = p.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _local_shards(source: str, root: str | None) -> list[Shard]:
    p = Path(source)
    if p.is_dir():
        if _is_hf_dir(p):
            return [Shard(str(p), "hf", root or str(p.parent), _local_key(p))]
        if (p / "dataset_dict.json").is_file():
            raise KeyeInputError("a saved DatasetDict: pass one split's folder (e.g. DIR/train)", path=p)
        files = sorted(f for f in p.rglob("*") if f.is_file() and _kind_of(f.name))
        subsets = sorted(d for d in p.rglob("*") if d.is_dir() and _is_hf_dir(d))
        if not files and not subsets:
            raise KeyeInputError(f"folder holds no {', '.join(SHARD_SUFFIXES)} shard or saved dataset", path=p)
        out = [s for f in files for s in _local_shards(str(f), root)]
        return out + [Shard(str(d), "hf", root or str(d.parent), _local_key(d)) for d in subsets]
    if any(c in source for c in "*?["):
        found = sorted(_glob.glob(source, recursive=True))
        if not found:
            raise KeyeInputError("glob matches no file", path=source)
        return [s for f in found for s in _local_shards(f, root)]
    if not p.exists():
        raise KeyeInputError("source not found", path=p)
    kind = _kind_of(p.name)
    if kind is None:
        raise KeyeInputError(f"unknown source type (expected {', '.join(SHARD_SUFFIXES)} or a folder)", path=p)
    return [Shard(os.path.abspath(p), kind, root or str(p.resolve().parent), _local_key(p))]


def _remote_shards(source: str, root: str | None) -> list[Shard]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(source)
    proto = source.split("://", 1)[0]

    def url(p: str) -> str:
        return p if "://" in p else f"{proto}://{p.lstrip('/') if proto == 'memory' else p}"

    if any(c in path for c in "*?["):
        paths = sorted(fs.glob(path))
    elif fs.isdir(path):
        paths = sorted(f for f in fs.find(path) if _kind_of(f))
    elif fs.exists(path):
        paths = [path]
    else:
        raise KeyeInputError("source not found", path=source)
    out = []
    for p in paths:
        kind = _kind_of(p)
        if kind is None:
            continue
        info = fs.info(p)
        key = str(info.get("ETag") or info.get("etag") or f"{info.get('size')}:{info.get('mtime') or info.get('created')}")
        out.append(Shard(url(p), kind, root or url(p).rsplit("/", 1)[0], key))
    if not out:
        raise KeyeInputError(f"no {', '.join(SHARD_SUFFIXES)} shard found", path=source)
    return out


def expand_sources(sources: list[str], root: str | None = None) -> list[Shard]:
    """The shards of every source, in the order given (a folder's or glob's files sorted by name).

    A source is a JSONL / Parquet / tar file, a folder (every such file under it, and saved datasets), a glob,
    a ``datasets`` folder made by ``save_to_disk``, or any of these as an fsspec URL (``file://`` is local).

    Raises:
        KeyeInputError: a source that does not exist, matches nothing or has an unknown type, naming it.
    """
    out: list[Shard] = []
    for src in sources:
        src = str(src)
        if src.startswith("file://"):
            src = src[len("file://"):]
        out += _remote_shards(src, root) if "://" in src else _local_shards(src, root)
    seen: set[str] = set()
    return [s for s in out if not (s.uri in seen or seen.add(s.uri))]


def shard_chunks(shard: Shard, number: int) -> list[Chunk]:
    """Cut ``shard`` (its position ``number`` in the index) into chunks read independently.

    Raises:
        KeyeInputError: the shard cannot be opened (a corrupt Parquet footer, an unreadable file).
    """
    try:
        if shard.kind == "jsonl" and shard.local:
            return _jsonl_chunks(shard, number)
        if shard.kind == "parquet":
            import pyarrow.parquet as pq

            with _open(shard.uri) as f:
                n = pq.ParquetFile(f).metadata.num_row_groups
            return [Chunk(number, shard.uri, "parquet", g) for g in range(n)]
        if shard.kind == "hf":
            n = len(_load_hf(shard.uri))
            return [Chunk(number, shard.uri, "hf", a, min(n, a + CHUNK_ROWS), a + 1) for a in range(0, n, CHUNK_ROWS)]
    except KeyeInputError:
        raise
    except Exception as err:  # noqa: BLE001 - any library's error on a broken file is one bad shard
        raise KeyeInputError(f"cannot read {shard.kind} shard: {type(err).__name__}: {err}", path=shard.uri) from err
    return [Chunk(number, shard.uri, shard.kind)]  # a tar, or a remote JSONL: read whole by one worker


def _jsonl_chunks(shard: Shard, number: int) -> list[Chunk]:
    """Byte ranges of about ``CHUNK_ROWS`` lines, cut at line ends (lines counted here, the rows parsed by the
    workers)."""
    out, start, line, rows = [], 0, 1, 0
    pos = 0
    chunk_line = 1
    with open(shard.uri, "rb") as f:
        while True:
            block = f.readlines(_CHUNK_BYTES)
            if not block:
                break
            for raw in block:
                pos += len(raw)
                line += 1
                rows += 1
                if rows >= CHUNK_ROWS:
                    out.append(Chunk(number, shard.uri, "jsonl", start, pos, chunk_line))
                    start, chunk_line, rows = pos, line, 0
    if pos > start:
        out.append(Chunk(number, shard.uri, "jsonl", start, pos, chunk_line))
    return out


def _open(uri: str, mode: str = "rb") -> Any:
    if "://" not in uri:
        return open(uri, mode)
    import fsspec

    return fsspec.open(uri, mode).open()


def _load_hf(path: str) -> Any:
    import datasets

    ds = datasets.load_from_disk(path)
    if isinstance(ds, datasets.DatasetDict):
        raise KeyeInputError("a saved DatasetDict: pass one split's folder", path=path)
    return ds


# ------------------------------------------------------------------------------------------ reading rows

RowItem = tuple[int, Any, int, int]  # (line, row object or a ValueError, byte offset or -1, byte length)


def drop_nulls(value: Any) -> Any:
    """``value`` with every ``None``-valued key of every nested dict removed (Arrow fills a struct's missing
    fields with nulls, so a row read back from Parquet / ``datasets`` gains keys its JSON form never had)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def _from_arrow(row: dict[str, Any]) -> dict[str, Any]:
    row = drop_nulls(row)
    for key in ("messages", "answers", "choices", "meta"):
        if isinstance(row.get(key), str) and row[key][:1] in "[{":
            row[key] = json.loads(row[key])  # nested columns stored as JSON text
    return row


def read_chunk(chunk: Chunk, media_dir: Path | None = None, root: str = "") -> Iterator[RowItem]:
    """The rows of ``chunk`` as ``(line, row, offset, length)``; ``row`` is a ``ValueError`` for a line that
    is not valid JSON (a bad row, never fatal). Media of tars and remote shards are made local under
    ``media_dir`` (their row then names the local copies).

    Raises:
        KeyeInputError: the shard itself cannot be read (truncated tar, corrupt Parquet), naming it.
    """
    try:
        if chunk.kind == "jsonl" and "://" not in chunk.uri:
            yield from _read_jsonl_range(chunk)
        elif chunk.kind == "jsonl":
            with _open(chunk.uri) as f:
                data = f.read()
            for line, obj, _, _ in _parse_lines(data, 0, 1):
                yield line, _localise(obj, root, media_dir, chunk.uri), -1, 0
        elif chunk.kind == "parquet":
            import pyarrow.parquet as pq

            with _open(chunk.uri) as f:
                pf = pq.ParquetFile(f)
                first = sum(pf.metadata.row_group(g).num_rows for g in range(chunk.start)) + 1
                rows = pf.read_row_group(chunk.start).to_pylist()
            for k, row in enumerate(rows):
                yield first + k, _localise(_from_arrow(row), root, media_dir, chunk.uri), -1, 0
        elif chunk.kind == "hf":
            rows = _load_hf(chunk.uri).with_format("arrow")[chunk.start:chunk.stop].to_pylist()
            for k, row in enumerate(rows):
                yield chunk.start + k + 1, _from_arrow(row), -1, 0
        elif chunk.kind == "tar":
            yield from _read_tar(chunk, media_dir)
        elif chunk.kind == "empty":
            return
        else:
            raise KeyeInputError(f"unknown shard kind {chunk.kind!r}", path=chunk.uri)
    except KeyeInputError:
        raise
    except Exception as err:  # noqa: BLE001 - a broken shard of any format is reported by name, then skipped
        raise KeyeInputError(f"cannot read {chunk.kind} shard: {type(err).__name__}: {err}", path=chunk.uri) from err


def _parse_lines(data: bytes, base: int, first_line: int) -> Iterator[RowItem]:
    pos, line = 0, first_line
    n = len(data)
    while pos < n:
        end = data.find(b"\n", pos)
        end = n if end < 0 else end
        raw = data[pos:end]
        if raw.strip():
            try:
                obj: Any = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                msg = f"invalid JSON: {err.msg} at column {err.colno}" if isinstance(err, json.JSONDecodeError) \
                    else f"invalid UTF-8: {err}"
                obj = ValueError(msg)
            yield line, obj, base + pos, end - pos
        pos, line = end + 1, line + 1


def _read_jsonl_range(chunk: Chunk) -> Iterator[RowItem]:
    with open(chunk.uri, "rb") as f:
        f.seek(chunk.start)
        data = f.read(chunk.stop - chunk.start)
    yield from _parse_lines(data, chunk.start, chunk.first_line)


def _media_values(row: Any) -> Iterator[tuple[dict[str, Any], str, int | None]]:
    """(content item, media key, frame index or None) of every media path in a row's messages."""
    msgs = row.get("messages") if isinstance(row, dict) else None
    for msg in msgs if isinstance(msgs, list) else []:
        content = msg.get("content") if isinstance(msg, dict) else None
        for item in content if isinstance(content, list) else []:
            if not isinstance(item, dict):
                continue
            for kind in MEDIA_TYPES:
                v = item.get(kind)
                if isinstance(v, str):
                    yield item, kind, None
                elif isinstance(v, list):
                    for j, f in enumerate(v):
                        if isinstance(f, str):
                            yield item, kind, j


def _get(item: dict[str, Any], kind: str, j: int | None) -> str:
    return item[kind] if j is None else item[kind][j]


def _set(item: dict[str, Any], kind: str, j: int | None, value: str) -> None:
    if j is None:
        item[kind] = value
    else:
        item[kind][j] = value


def _relative(value: str) -> bool:
    return not (value.startswith(("/", "data:")) or "://" in value)


def _localise(row: Any, root: str, media_dir: Path | None, uri: str) -> Any:
    """For a shard on a non-local file system: copy each relative media file to ``media_dir`` and name the copy."""
    if "://" not in root or media_dir is None or not isinstance(row, dict):
        return row
    import fsspec

    sub = media_dir / hashlib.sha1(root.encode()).hexdigest()[:12]
    for item, kind, j in list(_media_values(row)):
        v = _get(item, kind, j)
        if not _relative(v):
            continue
        dest = (sub / v).resolve()
        if not dest.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
            try:
                with fsspec.open(f"{root.rstrip('/')}/{v}", "rb") as src, open(tmp, "wb") as out:
                    out.write(src.read())
            except FileNotFoundError:
                continue  # left relative: the row is rejected as "file not found" with its path
            os.replace(tmp, dest)
        _set(item, kind, j, str(dest))
    return row


def _wds_key(name: str) -> tuple[str, str]:
    """WebDataset's split of a member name into (sample key, extension): at the first dot of the basename."""
    d, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext


def _read_tar(chunk: Chunk, media_dir: Path | None) -> Iterator[RowItem]:
    """A WebDataset shard: members grouped by key; ``KEY.json`` is the row; media values naming a member of the
    same key (by full name or extension) are extracted to ``media_dir/<shard>/`` and the row names the copy."""
    if media_dir is None:
        raise KeyeInputError("a tar shard needs a media folder to extract into", path=chunk.uri)
    stem = Path(chunk.uri.rsplit("/", 1)[-1]).name
    dest_dir = media_dir / f"{stem}-{hashlib.sha1(chunk.uri.encode()).hexdigest()[:8]}"
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    order: list[str] = []
    with _open(chunk.uri) as fobj, tarfile.open(fileobj=fobj, mode="r:*") as tar:
        for m in tar:
            if not m.isfile():
                continue
            key, ext = _wds_key(m.name)
            if key not in samples:
                samples[key] = {}
                order.append(key)
            samples[key][ext] = m
        for n, key in enumerate(order, start=1):
            members = samples[key]
            if "json" not in members:
                yield n, ValueError(f"sample {key!r} has no {key}.json member"), -1, 0
                continue
            try:
                row: Any = json.loads(tar.extractfile(members["json"]).read())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                yield n, ValueError(f"{key}.json is not valid JSON: {err}"), -1, 0
                continue
            if isinstance(row, dict):
                row.setdefault("id", key)
                _extract_media(tar, row, key, members, dest_dir)
            yield n, row, -1, 0


def _extract_media(tar: tarfile.TarFile, row: dict[str, Any], key: str, members: dict[str, tarfile.TarInfo],
                   dest_dir: Path) -> None:
    by_name = {m.name.rsplit("/", 1)[-1]: m for m in members.values()}
    for item, kind, j in list(_media_values(row)):
        v = _get(item, kind, j)
        m = by_name.get(v) or members.get(v.lstrip("."))
        if m is None:
            continue  # not a member: an ordinary path (absolute, or relative to the shard's folder)
        dest = dest_dir / m.name
        if not (dest.is_file() and dest.stat().st_size == m.size):
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(dest.name + f".{os.getpid()}.tmp")
            with open(tmp, "wb") as out:
                out.write(tar.extractfile(m).read())
            os.replace(tmp, dest)
        _set(item, kind, j, str(dest))
