"""Append-only JSONL files of records keyed by ``id`` that a crashed run resumes from.

``keye eval`` stores its predictions here (:mod:`keye.eval.runner`, one file per rank) and the AutoThink data
pipeline (:mod:`keye.data.autothink`) its rows, drops and failures; a run that crashed is resumed by skipping
the ids already present (a truncated last line from the crash is dropped).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from keye.errors import KeyeInputError


class PredictionStore:
    """Append-only JSONL file of prediction records, each a JSON object with a unique ``id``.

    Reading tolerates a crash mid-write: an undecodable *last* line is dropped (and cut from the file, so the
    next append starts on a clean line); an undecodable line elsewhere raises ``KeyeInputError`` naming it.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self, repair: bool = True) -> dict[str, dict[str, Any]]:
        """Return ``{id: record}`` of the stored records, in file order (later duplicates win).

        With ``repair`` (for the file's writer) a cut last line is removed from the file and a lost final
        newline restored; without it (another rank's file) the file is only read.
        """
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        records: dict[str, dict[str, Any]] = {}
        pos, line_no = 0, 0
        while pos < len(data):
            newline = data.find(b"\n", pos)
            end = len(data) if newline < 0 else newline + 1
            raw = data[pos:end]
            line_no += 1
            if raw.strip():
                try:
                    rec = json.loads(raw.decode("utf-8"))
                    if not isinstance(rec, dict) or "id" not in rec:
                        raise ValueError("not an object with an 'id'")
                except (ValueError, UnicodeDecodeError) as err:
                    if end >= len(data):
                        # The crash cut the last record short: forget it (it is answered again).
                        if repair:
                            self._truncate(pos)
                        return records
                    raise KeyeInputError(
                        f"line {line_no} is not a valid record ({err})", path=self.path
                    ) from err
                records[str(rec["id"])] = rec
            pos = end
        if repair and data and not data.endswith(b"\n"):
            # The last record is complete but its newline was lost: restore it before anything is appended.
            with open(self.path, "ab") as f:
                f.write(b"\n")
        return records

    def _truncate(self, size: int) -> None:
        with open(self.path, "r+b") as f:
            f.truncate(size)

    def append(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Append records (one JSON line each), flushed and fsynced so a crash loses at most the last line."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False, default=_json_default) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Return the records of a predictions JSONL (see :class:`PredictionStore`) in file order."""
    path = Path(path)
    if not path.is_file():
        raise KeyeInputError("predictions file not found", path=path)
    return list(PredictionStore(path).load().values())
