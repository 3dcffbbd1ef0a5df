"""training/autothink_trace_slips.py: its aggregation on constructed replies, and a small run end to end on a
tiny checkpoint (greedy and sampled think / no_think replies, scored, split by cause)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("autothink_trace_slips", REPO / "training/autothink_trace_slips.py")
slips = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slips)


def _row(dec, mode, qtype, passed, exact=False):
    return {"decoding": dec, "mode": mode, "type": qtype, "passed": passed, "trace_exact": exact}


def test_summarise_counts_accuracy_edges_and_causes():
    rows = [
        # greedy: think 2/2, no_think 1/2 -> edge +0.5; both think traces exact
        _row("greedy", "think", "count", True, True), _row("greedy", "think", "color", True, True),
        _row("greedy", "no_think", "count", False), _row("greedy", "no_think", "color", True),
        # sampled: think 1/4 (one wrong reply kept the exact trace), no_think 3/4 -> edge -0.5
        _row("T=1", "think", "count", True, True), _row("T=1", "think", "count", False, True),
        _row("T=1", "think", "color", False), _row("T=1", "think", "color", False),
        _row("T=1", "no_think", "count", True), _row("T=1", "no_think", "count", True),
        _row("T=1", "no_think", "color", True), _row("T=1", "no_think", "color", False),
    ]
    s = slips.summarise(rows)
    g, t = s["greedy"], s["T=1"]
    assert g["accuracy"] == {"think": 1.0, "no_think": 0.5} and g["edge"] == pytest.approx(0.5)
    assert g["think_trace_exact"] == 1.0 and g["wrong_think"] == 0
    assert g["edge_by_type"] == {"color": 0.0, "count": 1.0}
    assert t["replies_per_mode"] == 4 and t["edge"] == pytest.approx(-0.5)
    assert t["think_trace_exact"] == 0.5
    assert (t["wrong_think"], t["wrong_think_with_exact_trace"]) == (3, 1)
    assert t["edge_by_type"] == {"color": -0.5, "count": -0.5}


def test_small_run_scores_every_reply_and_writes_the_summary(tiny_ckpt, synth_set, tmp_path, capsys):
    rows = [json.loads(x) for x in synth_set["test"].read_text().splitlines()][:3]
    for r in rows:  # the reference trace the script compares with (keye data synth --modes writes it)
        r["modes"] = {"think": f"<think>the clip</think>{r['answer']}"}
    # next to the media, so the rows' relative video paths resolve
    data = synth_set["test"].parent / "slips_test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "slips.json"
    assert slips.main([str(tiny_ckpt), "--data", str(data), "--samples", "2", "--max-new-tokens", "4",
                       "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["questions"] == 3
    assert s["greedy"]["replies_per_mode"] == 3 and s["T=1"]["replies_per_mode"] == 6
    for dec in ("greedy", "T=1"):
        d = s[dec]
        n = d["replies_per_mode"]
        assert 0 <= d["accuracy"]["think"] <= 1 and 0 <= d["accuracy"]["no_think"] <= 1
        assert d["wrong_think"] == round(n * (1 - d["accuracy"]["think"]))
        assert 0 <= d["wrong_think_with_exact_trace"] <= d["wrong_think"]
        assert d["edge"] == pytest.approx(d["accuracy"]["think"] - d["accuracy"]["no_think"])
    assert "| greedy |" in capsys.readouterr().out


def test_a_row_without_a_reference_trace_is_named(tiny_ckpt, synth_set):
    row = json.loads(synth_set["test"].read_text().splitlines()[0])
    row.pop("modes", None)
    data = synth_set["test"].parent / "slips_no_trace.jsonl"
    data.write_text(json.dumps(row) + "\n")
    with pytest.raises(SystemExit, match=r"slips_no_trace.jsonl:1: no modes.think reference trace"):
        slips.main([str(tiny_ckpt), "--data", str(data)])
