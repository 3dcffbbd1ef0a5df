"""``keye data check`` on a set of any size: a JSONL manifest (or any source ``keye data index`` reads) or an
index folder, with memory bounded by a chunk of rows, not by the set.

A source that is not an index is indexed into a temporary folder first (rows parsed, probed and costed in
worker processes, written chunk by chunk; see :mod:`keye.data.index`); the report is then summed over the
index's columns one record batch at a time. The report is :func:`keye.data.manifest.check_manifest`'s: the
same bad rows (line, id, reason; sorted by line) and the same summary fields.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from keye.data.manifest import BadRow, CheckReport

_MODALITIES = ("text", "image", "video", "mixed")


def check_source(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    *,
    processor: Any = None,
    cache: Any = None,
    workers: int | None = None,
    progress: bool = False,
) -> CheckReport:
    """Validate a manifest, any indexable source, or an index folder, streaming (see the module docstring).

    Args:
        path: a JSONL file (or folder / glob / Parquet / tar / saved dataset / fsspec URL), or an index folder.
        root: directory relative media paths are relative to (default: each file's directory).
        processor: a :class:`~keye.processing.processor.KeyeProcessor` for exact token counts (default: the
            approximate stand-in of :func:`~keye.data.manifest.check_manifest`). For an index made with another
            processor, its rows are costed again (streaming too).
        cache: a :class:`~keye.data.probe.ProbeCache` (default: the user cache).
        workers: processes for probing (default: all CPUs; 0 = in-process).
        progress: show a progress bar.

    Returns:
        :class:`~keye.data.manifest.CheckReport` with ``manifest`` ``None`` (no set is held in memory).

    Raises:
        KeyeInputError: the source is missing or not readable at all.
    """
    from keye.data.index import build_index, is_index

    cache_path = None if cache is None else str(cache.path)
    if is_index(path):
        from keye.data.index import IndexTable, _make_cost_model
        from keye.data.table import cost_fingerprint

        table = IndexTable(path)
        want = cost_fingerprint(_make_cost_model(processor, None, cache_path))
        if want == table.fingerprint:
            return _report(table, exact=processor is not None, single=False)
        # Made for another processor: re-cost its rows (as stored, so tars' extracted media are reused).
        sources = [e["uri"] for e in table.shards]
    else:
        sources = [str(path)]
    with tempfile.TemporaryDirectory(prefix="keye-check-") as tmp:
        from keye.data.index import IndexTable

        build_index(sources, tmp, processor=processor, root=root, workers=workers, cache=cache_path,
                    progress=progress)
        table = IndexTable(tmp)
        return _report(table, exact=processor is not None, single=len(table.shards) == 1)


def _report(table: Any, *, exact: bool, single: bool) -> CheckReport:
    """The report of an index, summed one record batch at a time."""
    import numpy as np

    from keye.data.index import _open_ipc

    mods = dict.fromkeys(_MODALITIES, 0)
    n_img = n_vid = 0
    seconds = v_fl = l_fl = 0.0
    tokens = max_tokens = 0
    for e in table.shards:
        t = _open_ipc(table.path / "shards" / f"{e['number']:05d}.arrow")
        for batch in t.to_batches(max_chunksize=1 << 16):
            col = {k: batch.column(k).to_numpy(zero_copy_only=False)
                   for k in ("images", "videos", "duration", "tree_tokens", "vision_flops", "tree_llm_flops")}
            img, vid = col["images"] > 0, col["videos"] > 0
            mods["text"] += int((~img & ~vid).sum())
            mods["image"] += int((img & ~vid).sum())
            mods["video"] += int((vid & ~img).sum())
            mods["mixed"] += int((img & vid).sum())
            n_img += int(col["images"].sum())
            n_vid += int(col["videos"].sum())
            seconds += float(col["duration"].sum())
            tokens += int(col["tree_tokens"].sum())
            max_tokens = max(max_tokens, int(col["tree_tokens"].max(initial=0)))
            v_fl += float(np.sum(col["vision_flops"]))
            l_fl += float(np.sum(col["tree_llm_flops"]))
    bad = table.bad_rows
    if single:  # one file: lines are that file's, as check_manifest reports them
        bad = [BadRow(b.line, b.reason.split(": ", 1)[1], b.id) for b in bad]
    bad.sort(key=lambda b: b.line)
    shard_bad = [BadRow(0, f"{s['uri']}: {s['reason']}") for s in table.meta.get("bad_shards", [])]
    summary = {
        "rows": table.num_rows,
        "valid": len(table),
        "bad": len(bad) + len(shard_bad),
        "modalities": {k: v for k, v in sorted(mods.items()) if v},
        "images": n_img,
        "videos": n_vid,
        "video_seconds": seconds,
        "tokens": tokens,
        "tokens_exact": exact,
        "max_tokens": max_tokens,
        "vision_tflops": v_fl / 1e12,
        "llm_tflops": l_fl / 1e12,
    }
    return CheckReport(None, shard_bad + bad, summary)  # type: ignore[arg-type]


__all__ = ["check_source"]
