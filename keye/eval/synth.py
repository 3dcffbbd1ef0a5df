"""Evaluator for the synthetic video-QA set (``keye.data.synth``): accuracy per question type.

Input is the set's JSONL manifest (see :mod:`keye.data.manifest`): each row has ``id``, ``messages`` (the
user turn with the clip or image and the question; a trailing assistant turn holding the answer is dropped
before inference), ``answer``, ``answer_kind`` (``"mc"``: an option letter; ``"numeric"``: a number),
``question_type``, and optionally ``choices`` (option texts in letter order) and ``tolerance``.

Scoring rules (ours; the set has no official scorer):

- ``mc``: the letter is read from the post-processed response with
  :func:`keye.eval.extract.choice_letter` (letter opening the answer tail, last ``(X)``, a unique standalone
  letter, or the option text); correct when it equals ``answer``.
- ``numeric``: the answer number (:func:`keye.eval.extract.final_number`: the first number after an answer
  cue, else the last number of the response); correct when ``|pred - answer| <= tolerance`` (``tolerance`` from
  the row, default 0, plus 1e-9 for float round-off).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from keye.errors import KeyeInputError
from keye.eval.extract import choice_letter, final_number

ANSWER_KINDS = ("mc", "numeric")


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


def extract(response: str, item: Mapping[str, Any]) -> str | None:
    """Return the answer read from ``response``: an option letter (mc) or a number string, or None."""
    if item["answer_kind"] == "mc":
        choices = item.get("choices") or []
        if not choices:
            # Without option texts, accept any A-H letter as the option space.
            choices = [""] * 8
        return choice_letter(response, [str(c) for c in choices])
    return final_number(response)


def is_correct(prediction: str | None, item: Mapping[str, Any]) -> bool:
    """Apply the module's scoring rule to an extracted ``prediction`` (None is wrong)."""
    if prediction is None:
        return False
    if item["answer_kind"] == "mc":
        return prediction == str(item["answer"]).strip()
    try:
        diff = abs(float(prediction) - float(item["answer"]))
    except ValueError:
        return False
    return diff <= float(item.get("tolerance") or 0.0) + 1e-9


def score_records(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Score records (``id``, ``answer``, ``answer_kind``, ``question_type``, ``response``; optional
    ``choices``, ``tolerance``, ``modality``).

    Returns ``{"overall": row, "question_type": {t: row}, "answer_kind": {k: row}, "modality": {m: row},
    "per_item": {id: {"prediction", "correct"}}}`` with ``row = {"correct", "total", "accuracy"}``
    (accuracy a fraction; question types sorted by name). Raises ``KeyeInputError`` for a record without the
    required fields.
    """
    per_item: dict[str, dict[str, Any]] = {}
    tables: dict[str, dict[str, list[bool]]] = {"question_type": {}, "answer_kind": {}, "modality": {}}
    outcomes: list[bool] = []
    for rec in records:
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
    result["per_item"] = per_item
    return result
