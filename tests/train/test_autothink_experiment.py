"""The AutoThink experiment driver (training/autothink_experiment.py): its report arithmetic on constructed
evaluations, and a test-sized run of every stage end to end with resume and --from-stage."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("autothink_experiment", REPO / "training/autothink_experiment.py")
exp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(exp)


def _rec(qid, qtype, mode, correct, thought, tokens):
    return {"id": qid, "question_type": qtype, "mode": mode, "correct": correct, "thought": thought,
            "tokens": tokens, "used": mode}


def _eval():
    # 4 count questions where thinking helps (think 4/4, direct 1/4) and 4 colour questions where it does
    # not (think 2/4, direct 3/4). Auto thinks on 3 of the counts and 1 of the colours.
    recs = []
    for i in range(4):
        recs.append(_rec(f"c{i}", "count", "think", True, True, 40))
        recs.append(_rec(f"c{i}", "count", "no_think", i == 0, False, 2))
        recs.append(_rec(f"c{i}", "count", "auto", i != 3, i != 3, 45 if i != 3 else 6))
        recs.append(_rec(f"k{i}", "color", "think", i < 2, True, 30))
        recs.append(_rec(f"k{i}", "color", "no_think", i < 3, False, 2))
        recs.append(_rec(f"k{i}", "color", "auto", i < 3, i == 0, 35 if i == 0 else 6))
    return {"n": 8, "records": recs}


def test_analyse_on_a_constructed_evaluation():
    res = exp.analyse(_eval())
    s = res["summary"]
    assert s["think"]["accuracy"] == pytest.approx(6 / 8)
    assert s["no_think"]["accuracy"] == pytest.approx(4 / 8)
    assert s["auto"]["accuracy"] == pytest.approx(6 / 8)
    assert s["auto"]["think_rate"] == pytest.approx(4 / 8)
    assert res["better_fixed_mode"] == "think"
    # per question auto - think: counts 0,0,0,-1; colours 0,0,+1,0 -> mean 0, sample var 2/7
    vs = res["auto_minus_better_fixed"]
    assert vs["diff"] == pytest.approx(0.0)
    assert vs["se"] == pytest.approx(math.sqrt((2 / 7) / 8))
    auto_tokens = (3 * 45 + 6 + 35 + 3 * 6) / 8
    assert res["token_ratio_auto_over_think"] == pytest.approx(auto_tokens / 35)
    assert res["think_helps_by_type"] == pytest.approx({"count": 0.75, "color": -0.25})
    assert res["auto_think_rate_where_thinking_helps"]["rate"] == pytest.approx(0.75)
    assert res["auto_think_rate_where_it_does_not"]["rate"] == pytest.approx(0.25)
    t = res["targets"]
    assert t["auto_within_1pt_of_better_fixed"] and t["auto_thinks_more_where_it_helps"]
    assert not t["auto_tokens_le_0.6x_think"]
    assert res["auto_mean_tokens_by_choice"] == pytest.approx({"think": (3 * 45 + 35) / 4, "direct": 6.0})
    md = exp.markdown({"after SFT": res}, 8)
    assert f"| {auto_tokens / 35:.2f} (42.5 / 6.0 tokens) |" in md
    assert "| after SFT | auto | 75.0 | 50.0 | 24.2 |" in md
    assert "| count | 4 | +75.0 | 75.0 |" in md


def test_markdown_when_auto_never_thinks():
    ev = _eval()
    for r in ev["records"]:
        if r["mode"] == "auto":
            r.update(thought=False, tokens=6)
    res = exp.analyse(ev)
    assert res["auto_think_rate_where_thinking_helps"]["rate"] == 0.0
    assert not res["targets"]["auto_thinks_more_where_it_helps"]
    md = exp.markdown({"after AutoThink RL": res}, 8)
    assert "(- / 6.0 tokens)" in md and "nan" not in md


def test_paired_needs_the_same_questions():
    assert exp.paired({"a": True, "b": False}, {"a": True, "b": True}) == pytest.approx(
        {"diff": -0.5, "se": math.sqrt(0.5 / 2), "n": 2})
    with pytest.raises(ValueError, match="same"):
        exp.paired({"a": True}, {"b": True})


def test_extra_types_reach_both_splits(tmp_path):
    exp.make_data(tmp_path, 10, 6, 0, 303, 0, "mixed", {"when_gap": 100.0})
    data = tmp_path / "data"
    for path in (data / "train.jsonl", data / "test" / "test.jsonl"):
        kinds = [json.loads(x)["question_type"] for x in path.read_text().splitlines()]
        assert kinds.count("when_gap") >= len(kinds) // 2, kinds  # weight 100 beside the defaults' ~10
    assert json.loads((data / "DONE").read_text())["extra_types"] == {"when_gap": 100.0}
    from keye.errors import KeyeConfigError

    with pytest.raises(KeyeConfigError, match="expected TYPE=WEIGHT"):
        exp.main(["--quick", "--out", str(tmp_path / "bad"), "--extra-type", "when_gap"])
    assert not (tmp_path / "bad" / "data").exists()  # rejected before any stage ran


def test_rl_questions_from_their_own_seed(tmp_path):
    exp.make_data(tmp_path, 8, 4, 0, 303, 0, "mixed", {"when_sum": 100.0})
    path = exp.make_rl_data(tmp_path, 8, 505, 0, {"when_sum": 100.0})
    assert path == tmp_path / "rl_data" / "train.jsonl"
    rl = [json.loads(x) for x in path.read_text().splitlines()]
    sft = [json.loads(x) for x in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert len(rl) == 8 and all("auto_mode" not in r for r in rl)  # plain questions, no mode rows
    assert [r["meta"]["events"] for r in rl] != [r["meta"]["events"] for r in sft]  # other clips than the SFT's
    assert sum(r["question_type"] == "when_sum" for r in rl) >= 4
    stamp = path.stat().st_mtime_ns
    assert exp.make_rl_data(tmp_path, 8, 505, 0, {"when_sum": 100.0}) == path  # complete: reused, not redrawn
    assert path.stat().st_mtime_ns == stamp
    for seed in ("0", "303"):  # the build seed's questions are the SFT's; the test seed's are held out
        with pytest.raises(SystemExit):
            exp.main(["--quick", "--out", str(tmp_path / "bad"), "--rl-seed", seed])
    for flags in (["--helps-seed", "303"], ["--helps-seed", "505", "--rl-seed", "505"], ["--helps-test", "-1"]):
        with pytest.raises(SystemExit):  # the judging split is its own seed's
            exp.main(["--quick", "--out", str(tmp_path / "bad"), *flags])
    assert not (tmp_path / "bad" / "data").exists()


@pytest.mark.slow
def test_quick_run_end_to_end_resumes_and_redoes_from_a_stage(tmp_path, capsys):
    out = tmp_path / "at"
    assert exp.main(["--quick", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["n_test"] == 6 and (out / "report.md").is_file()
    res = report["results"]["after SFT"]
    assert {r["mode"] for r in json.loads((out / "eval_sft.json").read_text())["records"]} == set(exp.EVAL_MODES)
    assert res["summary"]["auto"]["n"] == 6
    assert (out / "sft" / "final" / "model.safetensors").is_file()
    from keye.processing.processor import KeyeProcessor

    tok = KeyeProcessor.from_pretrained(str(out / "sft" / "final")).tokenizer
    assert len(tok.encode("<analysis>")) == 1  # the trained checkpoint keeps the added tag tokens
    if exp.rl_available():
        assert (out / "rl" / "final" / "model.safetensors").is_file()
        assert "after AutoThink RL" in report["results"] and report["rl"] == "done"
    else:
        assert "not available" in json.loads((out / "rl_skipped.json").read_text())["skipped"]
        assert report["rl"].startswith("pending")
    helps = json.loads((out / "eval_helps.json").read_text())  # the second split judged every checkpoint
    assert set(helps) == {"split", "sft", *(["rl"] if exp.rl_available() else [])}
    assert {r["mode"] for r in helps["sft"]["records"]} == set(exp.HELPS_MODES) and helps["sft"]["n"] == 6
    assert res["think_helps_judged_on"] == helps["split"] and "seed 404" in helps["split"]
    capsys.readouterr()

    mtimes = {p: p.stat().st_mtime_ns for p in (out / "eval_sft.json", out / "sft" / "final" / "model.safetensors",
                                                 out / "data" / "train_modes.jsonl", out / "eval_helps.json")}
    assert exp.main(["--quick", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for stage in ("data", "init", "sft", "eval_sft", "rl", "eval_helps"):
        assert f"[{stage}] done already" in printed
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items())

    assert exp.main(["--quick", "--out", str(out), "--from-stage", "eval_sft"]) == 0
    printed = capsys.readouterr().out
    assert "[eval_sft] running" in printed and "[sft] done already" in printed
    assert (out / "eval_sft.json").stat().st_mtime_ns != mtimes[out / "eval_sft.json"]
    assert (out / "eval_helps.json").stat().st_mtime_ns != mtimes[out / "eval_helps.json"]  # a later stage
    assert (out / "sft" / "final" / "model.safetensors").stat().st_mtime_ns == \
        mtimes[out / "sft" / "final" / "model.safetensors"]

    if exp.rl_available():  # RL again, on questions of a seed the SFT never saw
        assert exp.main(["--quick", "--out", str(out), "--from-stage", "rl", "--rl-seed", "505"]) == 0
        capsys.readouterr()
        import yaml

        cfg = yaml.safe_load((out / "rl" / "config.yaml").read_text())
        assert cfg["data"]["manifest"] == str(out / "rl_data" / "train.jsonl")
        assert json.loads((out / "stages.json").read_text())["rl"]["rl_seed"] == 505


def test_types_where_thinking_helps_can_be_judged_on_another_split():
    # On the other split thinking helps colour (think 2/2, direct 0/2) and not count (1/2 vs 2/2): the
    # groups swap, auto's think rates still come from the held-out set itself.
    other = [_rec("o0", "color", "think", True, True, 30), _rec("o0", "color", "no_think", False, False, 2),
             _rec("o1", "color", "think", True, True, 30), _rec("o1", "color", "no_think", False, False, 2),
             _rec("o2", "count", "think", False, True, 30), _rec("o2", "count", "no_think", True, False, 2),
             _rec("o3", "count", "think", True, True, 30), _rec("o3", "count", "no_think", True, False, 2)]
    res = exp.analyse(_eval(), {"n": 4, "records": other}, "seed 9")
    assert res["think_helps_by_type"] == pytest.approx({"count": -0.5, "color": 1.0})
    assert res["think_helps_by_type_same_set"] == pytest.approx({"count": 0.75, "color": -0.25})
    assert res["auto_think_rate_where_thinking_helps"] == {"rate": pytest.approx(0.25), "n": 4, "types": ["color"]}
    assert res["auto_think_rate_where_it_does_not"]["rate"] == pytest.approx(0.75)
    assert not res["targets"]["auto_thinks_more_where_it_helps"]
    assert res["think_helps_judged_on"] == "seed 9" and res["helps_split_n"] == 4
    md = exp.markdown({"after SFT": res}, 8)
    assert "judged on seed 9." in md and "| count | 4 | +75.0 | -50.0 | 75.0 |" in md
    # a type the other split never asked is one where thinking does not help
    res = exp.analyse(_eval(), {"n": 2, "records": other[:4]}, "seed 9")
    assert res["think_helps_by_type"]["count"] == 0.0
    assert "the held-out set itself" in exp.markdown({"after SFT": exp.analyse(_eval())}, 8)
