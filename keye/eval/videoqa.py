"""Video-MME-style multiple-choice video QA over local videos.

Input is a JSONL file, one question per line::

    {"id": "001-1", "video": "videos/001.mp4",            # path relative to the JSONL file, or absolute
     "question": "What is the man holding?",
     "options": ["A. A cup.", "B. A phone.", "C. A pen.", "D. A book."],   # or ["A cup.", ...]
     "answer": "B",                                        # the gold letter
     "duration": "short", "domain": "Knowledge", "sub_category": "...", "task_type": "Object Recognition",
     "subtitles": "optional subtitle text"}

Prompt and scoring follow the official Video-MME protocol (``docs/evaluation.md`` section 4): the prompt of
the Video-MME README, and the extraction of the scorer it points to: trim, delete each answer prefix
(case-sensitive; the two pairs fused by missing commas in the original list are never removed), return
``""`` when more than 10 words remain without any of ``A-D``, otherwise the first ``A``-``D`` character
anywhere. The official accuracy counts only answered items (non-empty extraction); the strict accuracy,
counting unanswered items as wrong, is reported next to it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from keye.errors import KeyeInputError

LETTERS = ("A", "B", "C", "D")
INSTRUCTION = (
    "Select the best answer to the following multiple-choice question based on the video. "
    "Respond with only the letter (A, B, C, or D) of the correct option."
)
# The official prefix list as Python reads it: two pairs lack a separating comma and are fused into one
# string each, so "The best option is", "The correct option is", "Best answer:" and "Best option:" are never
# removed on their own.
ANSWER_PREFIXES = (
    "The best answer is",
    "The correct answer is",
    "The answer is",
    "The answer",
    "The best option isThe correct option is",  # fused in the original (missing comma)
    "Best answer:Best option:",  # fused in the original (missing comma)
    "Answer:",
    "Option:",
    "The correct answer",
    "The correct option",
)
_LETTER_RE = re.compile(r"[ABCD]")
_OPTION_PREFIX = re.compile(r"^[A-D]\.\s")
BREAKDOWN_KEYS = ("duration", "domain", "sub_category", "task_type")


def load_items(path: str | Path) -> list[dict[str, Any]]:
    """Read a Video-MME-style JSONL file (see the module docstring) into items with absolute video paths.

    Raises ``KeyeInputError`` naming the file and line for unreadable JSON, a missing field, a duplicate id,
    a number of options other than 4 or a gold outside ``A``-``D``.
    """
    path = Path(path)
    if not path.is_file():
        raise KeyeInputError("video QA file not found", path=path)
    items: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise KeyeInputError(f"line {n}: invalid JSON ({err.msg})", path=path) from err
        if not isinstance(row, dict):
            raise KeyeInputError(f"line {n}: not a JSON object", path=path)
        for key in ("video", "question", "options", "answer"):
            if key not in row:
                raise KeyeInputError(f"line {n}: missing {key!r}", path=path, item=row.get("id"))
        item_id = str(row.get("id", f"line-{n}"))
        if item_id in seen:
            raise KeyeInputError(f"line {n}: duplicate id", path=path, item=item_id)
        seen.add(item_id)
        options = [str(o) for o in row["options"]]
        if len(options) != 4:
            raise KeyeInputError(f"line {n}: expected 4 options, got {len(options)}", path=path, item=item_id)
        if row["answer"] not in LETTERS:
            raise KeyeInputError(f"line {n}: answer {row['answer']!r} is not A-D", path=path, item=item_id)
        video = Path(str(row["video"]))
        item = dict(row)
        item.update(
            id=item_id, options=options, video=str(video if video.is_absolute() else path.parent / video)
        )
        items.append(item)
    return items


def prompt_text(item: Mapping[str, Any], *, use_subtitles: bool = False) -> str:
    """Return the official Video-MME prompt of an item.

    ``[This video's subtitles are listed below:\\n{subs}\\n]`` (only with ``use_subtitles`` and non-empty
    subtitles), the instruction, the question, the four ``X. text`` options (a missing ``X. `` prefix is
    added), then ``The best answer is:``.
    """
    options = [o if _OPTION_PREFIX.match(o) else f"{LETTERS[i]}. {o}" for i, o in enumerate(item["options"])]
    head = ""
    if use_subtitles and item.get("subtitles"):
        head = f"This video's subtitles are listed below:\n{item['subtitles']}\n"
    return head + "\n".join([INSTRUCTION, str(item["question"]), *options, "The best answer is:"])


def build_conversation(
    item: Mapping[str, Any], *, use_subtitles: bool = False, video_options: Mapping[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Return the one-turn conversation: the video (with ``video_options`` such as ``fps`` / ``max_frames``
    passed through to the processor), then the prompt text."""
    video = {"type": "video", "video": item["video"], **dict(video_options or {})}
    return [
        {
            "role": "user",
            "content": [video, {"type": "text", "text": prompt_text(item, use_subtitles=use_subtitles)}],
        }
    ]


def extract_characters_regex(response: str) -> str:
    """Official Video-MME extraction: the first ``A``-``D`` after prefix removal, or ``""`` (unanswered)."""
    s = response.strip()
    for prefix in ANSWER_PREFIXES:
        s = s.replace(prefix, "")
    if len(s.split()) > 10 and not _LETTER_RE.search(s):
        return ""
    match = _LETTER_RE.search(s)
    return match[0] if match else ""


def record_for(item: Mapping[str, Any], raw_output: str, response: str) -> dict[str, Any]:
    """Return the predictions-file record of one answered item (the item's fields plus the outputs)."""
    rec = {k: v for k, v in item.items() if k != "subtitles"}
    rec["raw_output"] = raw_output
    rec["response"] = response
    return rec


def _acc(hits: int, n: int) -> float:
    return hits / n if n else 0.0


def score_records(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Score records (``id``, ``answer``, ``response`` and optional breakdown fields).

    Returns ``{"overall": row, "<key>": {value: row}}`` for :data:`BREAKDOWN_KEYS` present in the records,
    where ``row = {"total", "answered", "correct", "accuracy", "strict_accuracy"}``: ``accuracy`` is the
    official one (correct / answered), ``strict_accuracy`` is correct / total; fractions in [0, 1].
    The official printout shows ``accuracy * 100`` with 1 decimal. Also returns ``"per_item"``
    ``{id: {"extraction", "correct"}}``. Raises ``KeyeInputError`` for a record without the fields.
    """
    per_item: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[Any, list[tuple[bool, bool]]]] = {k: {} for k in BREAKDOWN_KEYS}
    overall: list[tuple[bool, bool]] = []
    for rec in records:
        for key in ("id", "answer", "response"):
            if key not in rec:
                raise KeyeInputError(f"video QA record has no {key!r} field", item=rec.get("id"))
        extraction = extract_characters_regex("" if rec["response"] is None else str(rec["response"]))
        outcome = (extraction != "", extraction == rec["answer"])
        per_item[str(rec["id"])] = {"extraction": extraction, "correct": outcome[1]}
        overall.append(outcome)
        for key in BREAKDOWN_KEYS:
            if rec.get(key) is not None:
                groups[key].setdefault(rec[key], []).append(outcome)

    def _row(outcomes: list[tuple[bool, bool]]) -> dict[str, Any]:
        answered = sum(a for a, _ in outcomes)
        correct = sum(c for _, c in outcomes)
        return {
            "total": len(outcomes),
            "answered": answered,
            "correct": correct,
            "accuracy": _acc(correct, answered),
            "strict_accuracy": _acc(correct, len(outcomes)),
        }

    result: dict[str, Any] = {"overall": _row(overall)}
    for key, table in groups.items():
        if table:
            result[key] = {value: _row(outs) for value, outs in table.items()}
    result["per_item"] = per_item
    return result
