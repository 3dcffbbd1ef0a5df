"""The multiple-choice probes (training/probe_mc.py): drill rows, the elimination baseline, the per-turn
first-token scoring on packed batches (checked against one unpacked forward per row), and a short run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("probe_mc", REPO / "training/probe_mc.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_lookup_rows_ask_every_option_once_and_answer_its_letter():
    for row in probe.lookup_rows(50, seed=3, tag="t"):
        msgs = row["messages"]
        options = dict(line.split(". ", 1) for line in msgs[0]["content"][0]["text"].splitlines()[1:]
                       if len(line) > 2 and line[1] == ".")
        asked = [m["content"][0]["text"].splitlines()[-1].removeprefix("Which option is ").split("?")[0]
                 for m in msgs[0::2]]
        letters = [m["content"][0]["text"] for m in msgs[1::2]]
        assert sorted(letters) == sorted(options)
        assert all(options[letter] == text for letter, text in zip(letters, asked))
    assert probe.lookup_rows(5, 1, "a") == probe.lookup_rows(5, 1, "a")


def test_elimination_baseline():
    def row(n):
        return {"messages": [{}] * (2 * n)}

    assert probe.elimination_baseline([row(4)]) == pytest.approx([1 / 4, 1 / 3, 1 / 2, 1.0])
    # turn 0 averages 1/4 and 1/2; the last turns only count the rows that have them
    assert probe.elimination_baseline([row(4), row(2)]) == pytest.approx([3 / 8, (1 / 3 + 1) / 2, 1 / 2, 1.0])


def test_question_rows_open_answer(synth_set):
    rows = probe.question_rows(synth_set["train"], open_answer=False)
    opened = probe.question_rows(synth_set["train"], open_answer=True)
    assert rows and len(rows) == len(opened)
    for r, o in zip(rows, opened):
        assert r["question_type"] in ("color", "shape")
        assert o["answer"] == r["choices"]["ABCD".index(r["answer"])]
        assert "Options" not in o["messages"][0]["content"][1]["text"]
        # the letter probe asks for and trains the letter, whatever the set's own answer format
        assert r["messages"][1]["content"][0]["text"] == r["answer"] and r["answer"] in "ABCD"
        assert r["messages"][0]["content"][1]["text"].endswith("Answer with the option's letter.")


def test_first_token_accuracy_matches_unpacked_rows(tiny_ckpt, tmp_path):
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor

    proc = KeyeProcessor.from_pretrained(tiny_ckpt)
    model = KeyeVL.from_pretrained(tiny_ckpt, torch_dtype="float32")
    rows = probe.lookup_rows(6, seed=0, tag="x")
    torch.manual_seed(0)
    with torch.no_grad():  # make some answers right so the count is not trivially zero
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    packed = probe.cached_batches(rows, tmp_path / "p.jsonl", proc, tmp_path, 100000, shuffle=False)
    assert len(packed) == 1
    got = probe.first_token_accuracy(model, packed)
    want: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        one = probe.cached_batches([r], tmp_path / f"r{i}.jsonl", proc, tmp_path, 100000, shuffle=False)[0]
        with torch.no_grad():
            model.eval()
            pred = model(input_ids=one["input_ids"], labels=one["labels"]).logits[0, :-1].argmax(-1)
        lab = one["labels"][0]
        starts = ((lab[1:] != -100) & (lab[:-1] == -100)).nonzero().flatten().tolist()
        for t, pos in enumerate(starts):
            want.setdefault(t, [0, 0])
            want[t][0] += int(pred[pos] == lab[pos + 1])
            want[t][1] += 1
    assert got == [tuple(want[t]) for t in sorted(want)]
    assert sum(n for _, n in got) == sum(len(r["messages"]) // 2 for r in rows)


def test_short_lookup_run_writes_a_curve(tiny_ckpt, tmp_path):
    assert probe.main(["lookup", "--model", str(tiny_ckpt), "--steps", "2", "--eval-every", "1", "--train-rows",
                       "20", "--test-rows", "6", "--out", str(tmp_path), "--batch-tokens", "2048"]) == 0
    report = json.loads((tmp_path / "lookup.json").read_text())
    assert [p["step"] for p in report["curve"]] == [0, 1, 2]
    assert len(report["curve"][0]["elimination_baseline"]) == len(report["curve"][0]["per_turn"])
