"""Thinking-mode measurement for ``keye eval``: which mode each reply used, how often the model thought,
how many tokens it spent, accuracy per mode, per question type and per difficulty bucket, and paired
comparisons of two runs on the same questions (evaluation.md §8).

Definitions (the numbers the tables print):

- **mode used**: :func:`keye.processing.chat.parse_response` on the raw reply: ``think`` (a non-empty
  ``<think>`` block, no analysis), ``no_think`` (no or an empty think block), ``auto_think`` /
  ``auto_no_think`` (an ``<analysis>`` block first, then thinking or not). The *requested* mode is the run's
  ``--mode`` (the prompt switch); the mode used is what the reply did.
- **think rate**: the share of replies with a non-empty think block (``think`` + ``auto_think``); in auto
  mode, how often the model chose to think.
- **reply tokens**: tokens generated for the reply, EOS included (the runner stores ``reply_tokens`` per
  record; a reply cut by ``--max-new-tokens`` counts the budget). **think tokens**: the think block's text
  tokenised with the model's tokenizer (``think_tokens``; 0 without a think block). A mean is printed only
  when every reply of the group has a count.
- **pass rate** of a question: correct answers / sampled answers (``keye eval synth --samples N``), or
  read from a reference run (``--difficulty-from``). **Difficulty buckets** with edges ``lo < hi``
  (default 0.25, 0.75): *hard* ``p < lo``, *medium* ``lo <= p < hi``, *easy* ``p >= hi``; questions the
  reference does not rate are *unrated*.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError, KeyeInputError

MODES_USED = ("think", "no_think", "auto_think", "auto_no_think")
MODE_LABELS = {
    "think": "think",
    "no_think": "direct",
    "auto_think": "auto → think",
    "auto_no_think": "auto → direct",
}
DEFAULT_EDGES = (0.25, 0.75)
BUCKETS = ("easy", "medium", "hard")
UNRATED = "unrated"
_SAMPLE_ID = re.compile(r"^(.*)#s(\d+)$")

TokenCounter = Callable[[str], int]


# ------------------------------------------------------------------------------------------ one reply


def count_tokens(tokenizer: Any, text: str | None) -> int:
    """Number of tokens ``tokenizer`` (a transformers tokenizer) makes of ``text``, no special tokens
    added; 0 for empty text."""
    if not text:
        return 0
    enc = tokenizer(text, add_special_tokens=False)
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc
    return len(ids)


def reply_stats(
    raw: str, *, reply_tokens: int | None = None, tokenizer: Any = None
) -> dict[str, Any]:
    """Mode and token counts of one raw reply.

    Returns ``{"mode", "label", "thought", "reply_tokens", "think_tokens"}``: ``mode`` from
    :func:`keye.processing.chat.parse_response` (one of :data:`MODES_USED`), ``label`` its display name
    (:data:`MODE_LABELS`: ``think`` / ``direct`` / ``auto → think`` / ``auto → direct``), ``thought``
    whether the think block is non-empty. ``reply_tokens`` is the given generated-token count, else the
    reply re-tokenised with ``tokenizer``, else None; ``think_tokens`` is the think block tokenised with
    ``tokenizer`` (0 when there is no block, None when a block exists but no tokenizer is given).
    """
    from keye.processing.chat import parse_response

    parsed = parse_response(raw)
    thought = bool(parsed.think)
    if reply_tokens is None and tokenizer is not None:
        reply_tokens = count_tokens(tokenizer, raw)
    if not thought:
        think_tokens: int | None = 0
    else:
        think_tokens = count_tokens(tokenizer, parsed.think) if tokenizer is not None else None
    return {
        "mode": parsed.mode,
        "label": MODE_LABELS[parsed.mode],
        "thought": thought,
        "reply_tokens": reply_tokens,
        "think_tokens": think_tokens,
    }


def describe_reply(stats: Mapping[str, Any]) -> str:
    """One display line for a reply's :func:`reply_stats`: ``"mode: direct · 7 tokens"`` or
    ``"mode: auto → think · 42 tokens (30 thinking)"`` (token parts left out when unknown)."""
    parts = [f"mode: {stats['label']}"]
    if stats.get("reply_tokens") is not None:
        n = int(stats["reply_tokens"])
        tokens = f"{n} token{'s' if n != 1 else ''}"
        if stats.get("thought") and stats.get("think_tokens") is not None:
            tokens += f" ({int(stats['think_tokens'])} thinking)"
        parts.append(tokens)
    return " · ".join(parts)


# ------------------------------------------------------------------------------------------ samples


def question_id(record: Mapping[str, Any]) -> str:
    """The question a record answers: its ``question_id`` field, else its ``id`` without a ``#s<k>``
    sample suffix (see :func:`expand_samples`), else its ``id``."""
    if record.get("question_id") is not None:
        return str(record["question_id"])
    item_id = str(record["id"] if "id" in record else record.get("pid"))
    m = _SAMPLE_ID.match(item_id)
    return m.group(1) if m else item_id


def expand_samples(items: Sequence[Mapping[str, Any]], n: int) -> list[dict[str, Any]]:
    """``n`` copies of every item for multi-sample evaluation, the copies of one question adjacent.

    Copy ``k`` of item ``id`` gets ``id = "<id>#s<k>"``, ``question_id = <id>`` and ``sample = k``, so the
    runner stores (and resumes) each sampled answer as its own record. ``n == 1`` returns plain copies with
    ``question_id`` / ``sample`` added and the ids unchanged. Raises ``KeyeConfigError`` for ``n < 1``.
    """
    if n < 1:
        raise KeyeConfigError(f"--samples must be >= 1, got {n}")
    out = []
    for item in items:
        qid = str(item["id"])
        for k in range(n):
            out.append({**item, "id": qid if n == 1 else f"{qid}#s{k}", "question_id": qid, "sample": k})
    return out


def correct_map(per_item: Mapping[str, Mapping[str, Any]]) -> dict[str, bool]:
    """``{id: correct}`` from a benchmark scorer's ``per_item`` (``correct``, or MathVista's
    ``true_false``). Raises ``KeyeInputError`` naming an item with neither."""
    out = {}
    for item_id, info in per_item.items():
        if "correct" in info:
            out[str(item_id)] = bool(info["correct"])
        elif "true_false" in info:
            out[str(item_id)] = bool(info["true_false"])
        else:
            raise KeyeInputError("scored item has no 'correct' / 'true_false'", item=item_id)
    return out


def pass_rates(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-question pass rates of scored rows (each with ``correct`` and an ``id`` / ``question_id``).

    Returns ``{question_id: {"passed", "samples", "pass_rate"}}`` in first-seen order.
    """
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        entry = out.setdefault(question_id(row), {"passed": 0, "samples": 0, "pass_rate": 0.0})
        entry["passed"] += int(bool(row["correct"]))
        entry["samples"] += 1
    for entry in out.values():
        entry["pass_rate"] = entry["passed"] / entry["samples"]
    return out


def check_edges(edges: Sequence[float]) -> tuple[float, float]:
    """Validate bucket edges ``(lo, hi)`` with ``0 < lo < hi <= 1``; returns them as a tuple of floats.
    Raises ``KeyeConfigError`` otherwise."""
    if len(edges) != 2:
        raise KeyeConfigError(f"difficulty edges must be two numbers LO HI, got {list(edges)}")
    lo, hi = float(edges[0]), float(edges[1])
    if not 0.0 < lo < hi <= 1.0:
        raise KeyeConfigError(f"difficulty edges must satisfy 0 < LO < HI <= 1, got {lo}, {hi}")
    return lo, hi


def bucket_of(pass_rate: float | None, edges: Sequence[float] = DEFAULT_EDGES) -> str:
    """``"hard"`` (``p < lo``), ``"medium"`` (``lo <= p < hi``), ``"easy"`` (``p >= hi``), or
    ``"unrated"`` for None."""
    if pass_rate is None:
        return UNRATED
    lo, hi = check_edges(edges)
    if pass_rate >= hi:
        return "easy"
    if pass_rate >= lo:
        return "medium"
    return "hard"


# ----------------------------------------------------------------------------------------- scored rows


def reply_text(record: Mapping[str, Any]) -> str | None:
    """The reply of a prediction record: its ``raw_output`` (the decoded generation, tags intact), else its
    ``response``; None when it has neither."""
    for key in ("raw_output", "response"):
        if isinstance(record.get(key), str):
            return record[key]
    return None


def scored_rows(
    records: Iterable[Mapping[str, Any]],
    correct: Mapping[str, bool],
    *,
    group_key: str | None = "question_type",
    tokenizer: Any = None,
) -> list[dict[str, Any]]:
    """Join prediction records with their verdicts and reply statistics, one row per record.

    Args:
        records: prediction records (``id``, or MathVista's ``pid``; ``raw_output`` or ``response``;
            optional ``reply_tokens`` / ``think_tokens`` from the runner, ``question_id``, and the
            ``group_key`` field).
        correct: ``{id: bool}`` (see :func:`correct_map`); a record without a verdict is left out.
        group_key: record field the per-group table uses (None: no group).
        tokenizer: counts tokens of records without stored counts (see :func:`reply_stats`).

    Returns rows ``{"id", "question_id", "group", "mode", "thought", "correct", "reply_tokens",
    "think_tokens"}``. Raises ``KeyeInputError`` for a record without any reply text.
    """
    rows = []
    for rec in records:
        item_id = str(rec["id"] if "id" in rec else rec.get("pid"))  # official MathVista files key by pid
        if item_id not in correct:
            continue
        text = reply_text(rec)
        if text is None:
            raise KeyeInputError("record has no 'raw_output' or 'response' text", item=item_id)
        stats = reply_stats(text, reply_tokens=rec.get("reply_tokens"), tokenizer=tokenizer)
        if rec.get("think_tokens") is not None:  # counted by the runner from the same tokenizer
            stats["think_tokens"] = int(rec["think_tokens"])
        rows.append(
            {
                "id": item_id,
                "question_id": question_id(rec),
                "group": None if group_key is None or rec.get(group_key) is None else str(rec[group_key]),
                "mode": stats["mode"],
                "thought": stats["thought"],
                "correct": bool(correct[item_id]),
                "reply_tokens": stats["reply_tokens"],
                "think_tokens": stats["think_tokens"],
            }
        )
    return rows


def _mean(values: list[Any]) -> float | None:
    """Mean of ``values``; None when empty or when any value is unknown (a partial mean would mislead)."""
    if not values or any(v is None for v in values):
        return None
    return sum(float(v) for v in values) / len(values)


def _rate(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def summarise(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Aggregate scored rows: ``{"replies", "think_rate", "accuracy", "accuracy_think", "accuracy_direct",
    "mean_reply_tokens", "mean_think_tokens"}`` (fractions; None where a group is empty or a count is
    missing)."""
    thought = [r for r in rows if r["thought"]]
    direct = [r for r in rows if not r["thought"]]
    return {
        "replies": len(rows),
        "think_rate": _rate([bool(r["thought"]) for r in rows]),
        "accuracy": _rate([bool(r["correct"]) for r in rows]),
        "accuracy_think": _rate([bool(r["correct"]) for r in thought]),
        "accuracy_direct": _rate([bool(r["correct"]) for r in direct]),
        "mean_reply_tokens": _mean([r["reply_tokens"] for r in rows]),
        "mean_think_tokens": _mean([r["think_tokens"] for r in rows]),
    }


def mode_breakdown(
    rows: Sequence[Mapping[str, Any]],
    *,
    requested_mode: str | None = None,
    rates: Mapping[str, float] | None = None,
    edges: Sequence[float] = DEFAULT_EDGES,
) -> dict[str, Any]:
    """The per-mode breakdown of a run from its :func:`scored_rows`.

    Args:
        rows: scored rows.
        requested_mode: the run's ``--mode`` (None: no switch in the prompt, the model's default).
        rates: ``{question_id: pass_rate}`` for the difficulty buckets (None: no bucket table).
        edges: bucket edges ``(lo, hi)``.

    Returns ``{"requested_mode", "overall": summary, "mode_used": {mode: summary}, "group": {g: summary},
    "difficulty": {bucket: summary + "questions"} or None, "edges"}`` with summaries from :func:`summarise`
    (``mode_used`` in :data:`MODES_USED` order, only modes that occur; groups sorted by name).
    """
    edges = check_edges(edges)
    out: dict[str, Any] = {
        "requested_mode": requested_mode,
        "overall": summarise(rows),
        "mode_used": {},
        "group": {},
        "difficulty": None,
        "edges": list(edges),
    }
    for mode in MODES_USED:
        sub = [r for r in rows if r["mode"] == mode]
        if sub:
            out["mode_used"][mode] = summarise(sub)
    groups = sorted({r["group"] for r in rows if r.get("group") is not None})
    for g in groups:
        out["group"][g] = summarise([r for r in rows if r.get("group") == g])
    if rates is not None:
        by_bucket: dict[str, list[Mapping[str, Any]]] = {}
        for r in rows:
            by_bucket.setdefault(bucket_of(rates.get(r["question_id"]), edges), []).append(r)
        out["difficulty"] = {}
        for bucket in (*BUCKETS, UNRATED):
            sub = by_bucket.get(bucket, [])
            if sub or bucket != UNRATED:
                out["difficulty"][bucket] = {
                    **summarise(sub),
                    "questions": len({r["question_id"] for r in sub}),
                }
    return out


def _pct(value: float | None) -> float | None:
    return None if value is None else round(value * 100, 2)


def _tok(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


# Report column -> (summary field, how it prints), for the rows of :func:`breakdown_tables`.
_STAT_COLUMNS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "replies": ("replies", lambda v: v),
    "think rate %": ("think_rate", _pct),
    "accuracy %": ("accuracy", _pct),
    "accuracy thinking %": ("accuracy_think", _pct),
    "accuracy direct %": ("accuracy_direct", _pct),
    "mean reply tokens": ("mean_reply_tokens", _tok),
    "mean think tokens": ("mean_think_tokens", _tok),
}


def _stat_cells(s: Mapping[str, Any], *columns: str) -> dict[str, Any]:
    """The named report columns of one :func:`summarise` result, in the order given."""
    return {c: _STAT_COLUMNS[c][1](s[_STAT_COLUMNS[c][0]]) for c in columns}


def breakdown_tables(breakdown: Mapping[str, Any], group_name: str = "question_type") -> dict[str, list]:
    """Report tables (see :mod:`keye.eval.report`) of a :func:`mode_breakdown`.

    ``"thinking mode"``: an ``all`` row (with the requested mode) then one row per mode used;
    ``"thinking mode by <group_name>"`` when groups exist; ``"difficulty (pass-rate buckets)"`` when pass
    rates were given. Missing values print as ``None``.
    """
    requested = breakdown.get("requested_mode") or "none (model default)"
    total = breakdown["overall"]["replies"]

    def _row(name_key: str, name: str, s: Mapping[str, Any]) -> dict[str, Any]:
        return {name_key: name, "replies": s["replies"], "share %": _pct(s["replies"] / total) if total else None,
                **_stat_cells(s, "think rate %", "accuracy %", "mean reply tokens", "mean think tokens")}

    tables: dict[str, list] = {
        "thinking mode": [_row("mode used", f"all (requested: {requested})", breakdown["overall"])]
        + [_row("mode used", f"{m} ({MODE_LABELS[m]})", s) for m, s in breakdown["mode_used"].items()]
    }
    if breakdown["group"]:
        tables[f"thinking mode by {group_name}"] = [
            {group_name: g, **_stat_cells(s, *_STAT_COLUMNS)} for g, s in breakdown["group"].items()
        ]
    if breakdown.get("difficulty") is not None:
        lo, hi = breakdown["edges"]
        ranges = {"easy": f"p >= {hi:g}", "medium": f"{lo:g} <= p < {hi:g}", "hard": f"p < {lo:g}",
                  UNRATED: "no reference"}
        tables["difficulty (pass-rate buckets)"] = [
            {"bucket": b, "pass rate": ranges[b], "questions": s["questions"],
             **_stat_cells(s, "replies", "accuracy %", "think rate %", "mean reply tokens", "mean think tokens")}
            for b, s in breakdown["difficulty"].items()
        ]
    return tables


# ------------------------------------------------------------------------------------ reference files


def load_pass_rates(
    path: str | Path, score: Callable[[list[dict[str, Any]]], Mapping[str, bool]] | None = None
) -> dict[str, float]:
    """Per-question pass rates from a reference run, for ``--difficulty-from``.

    Accepted files:

    - ``modes.json`` of a run (its ``pass_rates``) or a JSON object ``{question_id: pass_rate}`` /
      ``{question_id: {"pass_rate": p}}``;
    - a ``judgements.jsonl`` / ``modes.jsonl`` (records with ``id`` and ``correct``, or MathVista's
      ``true_false``);
    - a ``predictions.jsonl`` (records without verdicts), scored with ``score`` (records -> ``{id: bool}``).

    Sample ids ``<id>#s<k>`` are pooled into their question. Raises ``KeyeInputError`` naming the file for
    an unreadable file, a rate outside [0, 1], or predictions without a ``score`` function.
    """
    from keye.eval.runner import read_records

    path = Path(path)
    if not path.is_file():
        raise KeyeInputError("difficulty reference not found", path=path)
    if path.suffix == ".jsonl":
        records = read_records(path)
        if not records:
            raise KeyeInputError("difficulty reference has no records", path=path)
        if all("correct" in r or "true_false" in r for r in records):
            verdicts = correct_map({str(r["id"]): r for r in records})
        elif score is None:
            raise KeyeInputError("records carry no 'correct' verdicts and no scorer was given", path=path)
        else:
            verdicts = dict(score(records))
        rows = [{**r, "correct": verdicts[str(r["id"])]} for r in records if str(r["id"]) in verdicts]
        return {q: e["pass_rate"] for q, e in pass_rates(rows).items()}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise KeyeInputError(f"cannot read JSON ({err})", path=path) from err
    if isinstance(data, dict) and isinstance(data.get("pass_rates"), dict):
        data = data["pass_rates"]
    if not isinstance(data, dict) or not data:
        raise KeyeInputError("expected a JSON object of per-question pass rates (or a run's modes.json)",
                             path=path)
    out = {}
    for qid, value in data.items():
        p = value.get("pass_rate") if isinstance(value, dict) else value
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) <= 1.0:
            raise KeyeInputError(f"pass rate of {qid!r} must be a number in [0, 1], got {p!r}", path=path)
        out[str(qid)] = float(p)
    return out


# ------------------------------------------------------------------------------------ paired comparison


def _per_question(rows: Iterable[Mapping[str, Any]], name: str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, list]] = {}
    for r in rows:
        if "correct" not in r:
            raise KeyeInputError(f"{name}: record has no 'correct' verdict", item=r.get("id"))
        entry = out.setdefault(question_id(r), {"correct": [], "tokens": []})
        entry["correct"].append(float(bool(r["correct"])))
        entry["tokens"].append(r.get("reply_tokens"))
    return {
        q: {"acc": sum(e["correct"]) / len(e["correct"]), "tokens": _mean(e["tokens"])}
        for q, e in out.items()
    }


def paired_diff(
    a_records: Iterable[Mapping[str, Any]], b_records: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """Paired comparison of two runs on the same questions (e.g. auto vs always-think).

    Each record needs ``correct`` (bool) and an ``id`` (or ``question_id``); ``reply_tokens`` is optional.
    Several samples of one question (ids ``<id>#s<k>``) are first averaged into the question's pass rate.
    Questions present in both runs are paired; with per-question scores ``a_i``, ``b_i`` and
    ``d_i = a_i - b_i`` over ``n`` pairs:

    - ``diff = mean(d)`` (accuracy of a minus accuracy of b, a fraction), ``se = sd(d) / sqrt(n)`` with the
      sample standard deviation (``n - 1``), ``ci95 = diff -/+ 1.96 se``;
    - ``token_ratio = mean(tok_a) / mean(tok_b)`` (ratio of mean reply tokens), with the delta-method
      standard error ``sd(tok_a_i - R tok_b_i) / (sqrt(n) mean(tok_b))``; None when a run lacks counts.

    Returns ``{"n", "acc_a", "acc_b", "diff", "se", "ci95", "tokens_a", "tokens_b", "token_ratio",
    "token_ratio_se", "unpaired_a", "unpaired_b"}`` (``se`` None for ``n < 2``). Raises ``KeyeInputError``
    when no question is in both runs or a record lacks its verdict.
    """
    a = _per_question(a_records, "a")
    b = _per_question(b_records, "b")
    common = [q for q in a if q in b]
    if not common:
        raise KeyeInputError("the two runs share no question ids; nothing to pair")
    n = len(common)
    da = [a[q]["acc"] for q in common]
    db = [b[q]["acc"] for q in common]
    d = [x - y for x, y in zip(da, db)]
    diff = sum(d) / n
    se = math.sqrt(sum((x - diff) ** 2 for x in d) / (n - 1)) / math.sqrt(n) if n > 1 else None
    out: dict[str, Any] = {
        "n": n,
        "acc_a": sum(da) / n,
        "acc_b": sum(db) / n,
        "diff": diff,
        "se": se,
        "ci95": None if se is None else [diff - 1.96 * se, diff + 1.96 * se],
        "tokens_a": None,
        "tokens_b": None,
        "token_ratio": None,
        "token_ratio_se": None,
        "unpaired_a": len(a) - n,
        "unpaired_b": len(b) - n,
    }
    ta = [a[q]["tokens"] for q in common]
    tb = [b[q]["tokens"] for q in common]
    if all(t is not None for t in ta + tb):
        mean_a, mean_b = sum(ta) / n, sum(tb) / n
        out["tokens_a"], out["tokens_b"] = mean_a, mean_b
        if mean_b > 0:
            ratio = mean_a / mean_b
            out["token_ratio"] = ratio
            if n > 1:
                resid = [x - ratio * y for x, y in zip(ta, tb)]
                sd = math.sqrt(sum(r * r for r in resid) / (n - 1))  # residuals have mean 0 by construction
                out["token_ratio_se"] = sd / (math.sqrt(n) * mean_b)
    return out


def paired_table(result: Mapping[str, Any], name_a: str = "a", name_b: str = "b") -> list[dict[str, Any]]:
    """One report row of a :func:`paired_diff` result (percentages and token means rounded)."""

    def r4(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    return [
        {
            "a": name_a,
            "b": name_b,
            "paired questions": result["n"],
            "accuracy a %": _pct(result["acc_a"]),
            "accuracy b %": _pct(result["acc_b"]),
            "a - b (points)": _pct(result["diff"]),
            "paired SE (points)": _pct(result["se"]),
            "mean tokens a": _tok(result["tokens_a"]),
            "mean tokens b": _tok(result["tokens_b"]),
            "token ratio a/b": r4(result["token_ratio"]),
            "token ratio SE": r4(result["token_ratio_se"]),
        }
    ]
