"""Evaluation reports: overall and per-category tables, written as ``report.json`` and ``report.md``.

A report is a plain dict::

    {"benchmark": "mmmu", "model_id": "...", "config": {...},            # how the run was made
     "overall": {"correct": 330, "total": 900, "acc": 0.367},           # one row
     "tables": {"title": [{"name": ..., "correct": ..., ...}, ...]},    # ordered rows per table
     "official": {...}}                                                 # the benchmark's own output

The ``*_report`` functions turn each benchmark's scores into ``(overall, tables)``. Columns whose name ends
in ``%`` hold percentages printed with 2 decimals; other numbers print as stored (MMMU's official 3-decimal
fractions stay as they are).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def _fmt(column: str, value: Any) -> str:
    if isinstance(value, float) and column.endswith("%"):
        return f"{value:.2f}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[Row]) -> str:
    """Render rows (dicts sharing the first row's keys) as a GitHub markdown table; ``""`` for no rows."""
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(c, row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def render_markdown(report: Mapping[str, Any]) -> str:
    """Return the markdown text of a report: title, model, config, overall row, then each table."""
    parts = [f"# {report['benchmark']} evaluation", "", f"- model: `{report.get('model_id')}`"]
    for key, value in (report.get("config") or {}).items():
        parts.append(f"- {key}: `{value}`")
    parts += ["", "## Overall", "", markdown_table([dict(report["overall"])])]
    for title, rows in (report.get("tables") or {}).items():
        parts += ["", f"## {title}", "", markdown_table(list(rows))]
    return "\n".join(parts) + "\n"


def write_report(
    out_dir: str | Path,
    *,
    benchmark: str,
    model_id: str | None,
    config: Mapping[str, Any],
    overall: Row,
    tables: Mapping[str, list[Row]],
    official: Any = None,
) -> dict[str, Path]:
    """Write ``report.json`` and ``report.md`` into ``out_dir`` (created); returns their paths by suffix."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": benchmark,
        "model_id": model_id,
        "config": dict(config),
        "overall": dict(overall),
        "tables": {k: list(v) for k, v in tables.items()},
        "official": official,
    }
    json_path, md_path = out / "report.json", out / "report.md"
    json_path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    md_path.write_text(render_markdown(report), encoding="utf-8")
    return {"json": json_path, "md": md_path}


def mmmu_report(
    printable: Mapping[str, Mapping[str, Any]], correct_by_id: Mapping[str, bool]
) -> tuple[Row, dict[str, list[Row]]]:
    """Overall row and the discipline/subject table of MMMU (official ``num``/``acc``, plus ``correct``)."""
    from keye.eval.mmmu import DOMAIN_CAT2SUB_CAT, subject_of

    per_subject: dict[str, int] = {}
    for item_id, ok in correct_by_id.items():
        per_subject[subject_of(item_id)] = per_subject.get(subject_of(item_id), 0) + int(ok)
    per_domain = {d: sum(per_subject.get(s, 0) for s in subs) for d, subs in DOMAIN_CAT2SUB_CAT.items()}
    rows = []
    for name, value in printable.items():
        if name == "Overall":
            continue
        correct = (
            per_domain[name[len("Overall-") :]] if name.startswith("Overall-") else per_subject.get(name, 0)
        )
        rows.append({"name": name, "correct": correct, "num": value["num"], "acc": value["acc"]})
    overall = {
        "correct": sum(per_subject.values()),
        "num": printable["Overall"]["num"],
        "acc": printable["Overall"]["acc"],
    }
    return overall, {"Disciplines and subjects (official printout)": rows}


def _pct(acc: float) -> float:
    return round(acc * 100, 2)


def mathvista_report(scores: Mapping[str, Any]) -> tuple[Row, dict[str, list[Row]]]:
    """Overall row and one table per breakdown key of MathVista (official order; accuracy in %)."""
    avg = scores["average"]
    overall = {"correct": avg["correct"], "total": avg["total"], "accuracy %": _pct(avg["accuracy"])}
    tables = {
        key: [
            {key: value, "correct": v["correct"], "total": v["total"], "accuracy %": _pct(v["accuracy"])}
            for value, v in table.items()
        ]
        for key, table in scores.items()
        if key != "average"
    }
    return overall, tables


def videoqa_report(result: Mapping[str, Any]) -> tuple[Row, dict[str, list[Row]]]:
    """Overall row and one table per breakdown (official accuracy over answered items, and strict)."""

    def _row(name_key: str, name: Any, r: Mapping[str, Any]) -> Row:
        return {
            name_key: name,
            "correct": r["correct"],
            "answered": r["answered"],
            "total": r["total"],
            "accuracy %": _pct(r["accuracy"]),
            "strict accuracy %": _pct(r["strict_accuracy"]),
        }

    overall = {k: v for k, v in _row("set", "all", result["overall"]).items() if k != "set"}
    tables = {
        key: [_row(key, value, r) for value, r in table.items()]
        for key, table in result.items()
        if key not in ("overall", "per_item")
    }
    return overall, tables


def synth_report(result: Mapping[str, Any]) -> tuple[Row, dict[str, list[Row]]]:
    """Overall row and per question type / answer kind / modality tables of the synthetic set."""
    overall = {
        "correct": result["overall"]["correct"],
        "total": result["overall"]["total"],
        "accuracy %": _pct(result["overall"]["accuracy"]),
    }
    tables = {
        key: [
            {key: v, "correct": r["correct"], "total": r["total"], "accuracy %": _pct(r["accuracy"])}
            for v, r in table.items()
        ]
        for key, table in result.items()
        if key not in ("overall", "per_item", "majority")
    }
    majority = result.get("majority")
    if majority:  # the blind baseline next to each type (what ignoring the pixels would score)
        overall["majority %"] = _pct(majority["overall"]["accuracy"])
        for row in tables.get("question_type", []):
            base = majority["question_type"].get(row["question_type"])
            row["majority %"] = _pct(base["accuracy"]) if base else None
    return overall, tables
