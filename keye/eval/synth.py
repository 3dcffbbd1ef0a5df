"""Evaluator for the synthetic video-QA set (``keye.data.synth``): accuracy per question type.

Input is the set's JSONL manifest (see :mod:`keye.data.manifest`): each row has ``id``, ``messages`` (the
user turn with the clip or image and the question; a trailing assistant turn holding the answer is dropped
before inference), ``answer``, ``answer_kind`` (``"mc"``: an option letter; ``"numeric"``: a number),
``question_type``, and optionally ``choices`` (option texts in letter order) and ``tolerance``.

Scoring rules (ours; the set has no official scorer): :mod:`keye.data.synth_answers` (an option letter or
the option's text for ``mc``, the answer number within ``tolerance`` for ``numeric``); its ``extract`` and
``is_correct`` are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from keye.data.synth_answers import ANSWER_KINDS, extract, is_correct
from keye.errors import KeyeInputError

__all__ = [
    "ANSWER_KINDS",
    "blank_items",
    "build_conversation",
    "extract",
    "is_correct",
    "load_items",
    "majority_baseline",
    "record_for",
    "score_records",
]


def load_items(path: str | Path) -> list[dict[str, Any]]:
    """Read a synthetic-set manifest into evaluation items with absolute media paths.

    Each item has ``id``, ``messages`` (user/system turns only), ``answer`` (str), ``answer_kind``,
    ``question_type``, ``choices`` (list or None), ``tolerance`` (float or None) and ``modality``.
    Raises ``KeyeInputError`` for an unreadable file, any malformed row (line and reason), or a row without
    ``answer`` / a valid ``answer_kind`` / ``question_type``.
    """
    from keye.data.manifest import read_manifest

    manifest = read_manifest(path)
    if manifest.bad_rows:
        raise KeyeInputError("malformed rows: " + "; ".join(str(b) for b in manifest.bad_rows[:5]), path=path)
    items = []
    for s in manifest.samples:
        row = s.row
        for key in ("answer", "answer_kind", "question_type"):
            if key not in row:
                raise KeyeInputError(f"line {s.line}: missing {key!r}", path=path, item=s.id)
        if row["answer_kind"] not in ANSWER_KINDS:
            raise KeyeInputError(
                f"line {s.line}: answer_kind must be one of {ANSWER_KINDS}", path=path, item=s.id
            )
        messages = list(s.messages)
        while messages and messages[-1].get("role") == "assistant":
            messages.pop()
        if not messages:
            raise KeyeInputError(f"line {s.line}: no user turn", path=path, item=s.id)
        items.append(
            {
                "id": s.id,
                "messages": messages,
                "answer": str(row["answer"]),
                "answer_kind": row["answer_kind"],
                "question_type": str(row["question_type"]),
                "choices": row.get("choices"),
                "tolerance": row.get("tolerance"),
                "modality": s.modality,
            }
        )
    return items


def build_conversation(item: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Return the item's conversation (its stored messages, answer turn removed)."""
    return [dict(m) for m in item["messages"]]


def record_for(item: Mapping[str, Any], raw_output: str, response: str) -> dict[str, Any]:
    """Return the predictions-file record of one answered item (no messages, JSON-serialisable)."""
    rec = {
        k: item.get(k)
        for k in ("id", "answer", "answer_kind", "question_type", "choices", "tolerance", "modality")
    }
    rec["raw_output"] = raw_output
    rec["response"] = response
    return rec


def score_records(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Score records (``id``, ``answer``, ``answer_kind``, ``question_type``, ``response``; optional
    ``choices``, ``tolerance``, ``modality``).

    Returns ``{"overall": row, "question_type": {t: row}, "answer_kind": {k: row}, "modality": {m: row},
    "majority": majority_baseline(records), "per_item": {id: {"prediction", "correct"}}}`` with ``row = {"correct", "total", "accuracy"}``
    (accuracy a fraction; question types sorted by name). Raises ``KeyeInputError`` for a record without the
    required fields.
    """
    per_item: dict[str, dict[str, Any]] = {}
    tables: dict[str, dict[str, list[bool]]] = {"question_type": {}, "answer_kind": {}, "modality": {}}
    outcomes: list[bool] = []
    records_list = list(records)
    for rec in records_list:
        for key in ("id", "answer", "answer_kind", "question_type", "response"):
            if key not in rec:
                raise KeyeInputError(f"synth record has no {key!r} field", item=rec.get("id"))
        prediction = extract("" if rec["response"] is None else str(rec["response"]), rec)
        ok = is_correct(prediction, rec)
        per_item[str(rec["id"])] = {"prediction": prediction, "correct": ok}
        outcomes.append(ok)
        for key, table in tables.items():
            if rec.get(key) is not None:
                table.setdefault(str(rec[key]), []).append(ok)

    def _row(oks: list[bool]) -> dict[str, Any]:
        return {"correct": sum(oks), "total": len(oks), "accuracy": sum(oks) / len(oks) if oks else 0.0}

    result: dict[str, Any] = {"overall": _row(outcomes)}
    for key, table in tables.items():
        result[key] = {v: _row(table[v]) for v in sorted(table)}
    result["majority"] = majority_baseline(records_list)
    result["per_item"] = per_item
    return result


def majority_baseline(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Accuracy of the blind baseline that answers every question of a type with that type's most common
    answer among ``records`` (ties: the smallest answer string), scored with :func:`is_correct`.

    This is the score a model that ignores the pixels can reach from the text alone (the question type is
    in the question), so a model given blank clips should land near it. Returns
    ``{"overall": row, "question_type": {t: row}, "answer": {t: answer}}`` with rows as in
    :func:`score_records`.
    """
    by_type: dict[str, list[Mapping[str, Any]]] = {}
    for rec in records:
        by_type.setdefault(str(rec["question_type"]), []).append(rec)
    out: dict[str, Any] = {"overall": None, "question_type": {}, "answer": {}}
    hits = total = 0
    for t in sorted(by_type):
        recs = by_type[t]
        counts: dict[str, int] = {}
        for r in recs:
            counts[str(r["answer"]).strip()] = counts.get(str(r["answer"]).strip(), 0) + 1
        guess = min(counts, key=lambda a: (-counts[a], a))
        ok = sum(is_correct(guess, r) for r in recs)
        out["question_type"][t] = {"correct": ok, "total": len(recs), "accuracy": ok / len(recs)}
        out["answer"][t] = guess
        hits, total = hits + ok, total + len(recs)
    out["overall"] = {"correct": hits, "total": total, "accuracy": hits / total if total else 0.0}
    return out


def _blank_scene(width: int, height: int, fps: Any = 0, frames: int = 1) -> Any:
    from keye.data.synth import Scene

    # No objects: the synthetic renderer then draws only the background, frame after frame.
    return Scene(width, height, fps, frames / fps if fps else 0.0, [], "blank", "", "", "text")


def _blank_video(src: Path, dest: Path) -> None:
    import av

    from keye.data.synth import write_video

    with av.open(str(src)) as c:
        stream = c.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or 1
        n = sum(1 for _ in c.decode(video=0))
        w, h = stream.codec_context.width, stream.codec_context.height
    write_video(dest, _blank_scene(w, h, rate, n))


def _blank_image(src: Path, dest: Path) -> None:
    from PIL import Image

    from keye.data.synth import write_image

    with Image.open(src) as im:
        w, h = im.size
    write_image(dest, _blank_scene(w, h))


def blank_items(items: Iterable[Mapping[str, Any]], media_dir: str | Path) -> list[dict[str, Any]]:
    """The control condition: ``items`` with every image or video replaced by a blank one (the synthetic
    set's background colour, no objects) of the same size and, for videos, the same frame rate and number
    of frames, so the prompt (frame and timestamp tokens included) is unchanged and only the pixel content
    is gone. Blank files are written under ``media_dir`` (reused when present). Raises ``KeyeInputError``
    naming the file when a clip cannot be read.
    """
    media_dir = Path(media_dir)
    media_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for item in items:
        new_item = dict(item)
        messages = []
        for m in item["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                new_content = []
                for k, c in enumerate(content):
                    kind = c.get("type") if isinstance(c, Mapping) else None
                    if kind in ("image", "video") and isinstance(c.get(kind), str):
                        src = Path(c[kind])
                        dest = media_dir / f"{item['id']}-{k}{src.suffix if kind == 'video' else '.png'}"
                        if not dest.is_file():
                            try:
                                (_blank_video if kind == "video" else _blank_image)(src, dest)
                            except Exception as err:  # noqa: BLE001 - any decoder error means this file is unusable
                                raise KeyeInputError(f"cannot read {kind} to blank it: {err}", path=src,
                                                     item=item.get("id")) from None
                        c = {**c, kind: str(dest)}
                    new_content.append(c)
                m = {**m, "content": new_content}
            messages.append(m)
        new_item["messages"] = messages
        out.append(new_item)
    return out
