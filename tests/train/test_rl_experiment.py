"""The GRPO-vs-RLEP experiment driver (training/rl_experiment.py): its comparison arithmetic, and a
test-sized run of the committed configs end to end (pool collection, both runs, report)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("rl_experiment", REPO / "training/rl_experiment.py")
rl_experiment = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rl_experiment)


def _curve(*acc):
    return [{"step": 10 * i, "accuracy": a, "n": 100.0} for i, a in enumerate(acc)]


def test_compare_finds_the_step_rlep_reaches_the_baseline_best():
    s = rl_experiment.compare(_curve(0.50, 0.55, 0.60, 0.58), _curve(0.50, 0.61, 0.59, 0.66))
    assert s["start_accuracy"] == 0.50 and s["n_eval"] == 100
    assert (s["grpo_best"], s["grpo_best_step"]) == (0.60, 20)
    assert (s["rlep_best"], s["rlep_best_step"]) == (0.66, 30)
    assert s["rlep_reaches_baseline_best_at"] == 10
    assert (s["grpo_final"], s["rlep_final"]) == (0.58, 0.66)


def test_compare_ignores_the_shared_start():
    # both runs fall below the start: the baseline's best is its best *trained* point, and step 0 (the
    # same checkpoint for both) never counts as RLEP reaching it
    s = rl_experiment.compare(_curve(0.50, 0.40, 0.45), _curve(0.50, 0.44, 0.46))
    assert (s["grpo_best"], s["grpo_best_step"]) == (0.45, 20)
    assert (s["rlep_best"], s["rlep_best_step"]) == (0.46, 20)
    assert s["rlep_reaches_baseline_best_at"] == 20


def test_compare_reports_never_reaching_and_rejects_empty_curves():
    s = rl_experiment.compare(_curve(0.5, 0.7), _curve(0.5, 0.6))
    assert s["rlep_reaches_baseline_best_at"] is None
    assert "no." in rl_experiment.markdown(s, _curve(0.5, 0.7), _curve(0.5, 0.6))
    with pytest.raises(ValueError, match="eval curve"):
        rl_experiment.compare([], _curve(0.5))


def test_markdown_with_sampled_accuracy_has_four_columns():
    def curve(*pairs):
        return [{"step": 10 * i, "accuracy": a, "sampled_accuracy": b, "samples": 4.0, "n": 100.0}
                for i, (a, b) in enumerate(pairs)]

    g, r = curve((0.5, 0.3), (0.4, 0.35)), curve((0.5, 0.3), (0.45, 0.4))
    s, samp = rl_experiment.compare(g, r), rl_experiment.compare(g, r, "sampled_accuracy")
    assert (samp["start_accuracy"], samp["grpo_best"], samp["rlep_best"]) == (0.3, 0.35, 0.4)
    md = rl_experiment.markdown(s, g, r, samp)
    assert "| RL step | GRPO greedy % | RLEP greedy % | GRPO avg@4 % | RLEP avg@4 % |" in md
    assert "| 10 | 40.0 | 45.0 | 35.0 | 40.0 |" in md
    assert "avg@k sampled accuracy on 100 questions. SFT start 30.0 %" in md


def test_paired_differences_and_standard_errors():
    start = {"a": [1, 2, 4], "b": [0, 0, 4], "c": [1, 4, 4]}
    run = {"a": [0, 3, 4], "b": [1, 2, 4], "c": [1, 4, 4]}
    p = rl_experiment.paired(start, run, {"a": "numeric", "b": "numeric", "c": "mc"})
    assert list(p) == ["all", "mc", "numeric"] and p["all"]["n"] == 3 and p["numeric"]["n"] == 2
    g, smp = p["all"]["greedy"], p["all"]["sampled"]
    assert (g["start"], g["diff"]) == (pytest.approx(2 / 3), 0.0) and g["se"] == pytest.approx((1 / 3) ** 0.5)
    assert smp["start"] == pytest.approx(0.5) and smp["run"] == pytest.approx(0.75)
    assert smp["diff"] == pytest.approx(0.25) and smp["se"] == pytest.approx((0.0625 / 3) ** 0.5)
    assert p["numeric"]["greedy"]["se"] == pytest.approx(1.0)
    assert p["numeric"]["sampled"]["diff"] == pytest.approx(0.375) and p["numeric"]["sampled"]["se"] == pytest.approx(0.125)
    assert p["mc"]["sampled"] == {"start": 1.0, "run": 1.0, "diff": 0.0, "se": None}  # one question: no spread
    md = rl_experiment.final_markdown({"samples": 4, "n": 3, "paired": {"rlep": p}})
    assert "| RLEP | numeric (2) | 50.0 -> 50.0 (+0.0 +- 100.0) | 25.0 -> 62.5 (+37.5 +- 12.5) |" in md
    md = rl_experiment.final_markdown({"samples": 4, "n": 3, "paired": {"rlep": p}, "versus": {"rlep - grpo": p}})
    assert "| RLEP vs GRPO (GRPO -> RLEP) | numeric (2) | 50.0 -> 50.0 (+0.0 +- 100.0) |" in md


def test_markdown_table_lists_every_step_of_both_runs():
    g, r = _curve(0.5, 0.6), _curve(0.5, 0.625, 0.7)
    md = rl_experiment.markdown(rl_experiment.compare(g, r), g, r)
    assert "| 0 | 50.0 | 50.0 |" in md and "| 10 | 60.0 | 62.5 |" in md and "| 20 | - | 70.0 |" in md
    assert "reaches the baseline's best at step 10." in md


@pytest.mark.slow
def test_test_sized_experiment_runs_both_configs_from_one_start(tiny_ckpt, synth_set, tmp_path):
    rows = [json.loads(x) for x in synth_set["train"].read_text().splitlines()]
    cost = lambda r: r["meta"]["num_frames"] * r["meta"]["width"] * r["meta"]["height"]  # noqa: E731
    data = synth_set["train"].parent / "rlx_train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=cost)[:3]))
    out = tmp_path / "rlx"
    cmd = [sys.executable, "training/rl_experiment.py", "--policy", str(tiny_ckpt), "--data", str(data),
           "--test", str(synth_set["test"]), "--questions", "3", "--kind", "all", "--n", "2", "--final-samples", "2", "--steps", "2", "--out", str(out),
           "data.prompts_per_step=2", "rollout.G=2", "rollout.max_new_tokens=4", "eval.limit=2", "eval.every=1",
           "eval.max_new_tokens=3", "algorithm.micro_batch_size=4", "log.progress=false", "log.tensorboard=false",
           "train.device=cpu"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    for name in ("grpo", "rlep"):
        assert [c["step"] for c in report[name]] == [0, 1, 2]
        assert json.loads((out / name / "summary.json").read_text())["finished"]
    # one start: both runs evaluate the same SFT checkpoint greedily before their first step
    assert report["grpo"][0]["accuracy"] == report["rlep"][0]["accuracy"] == report["summary"]["start_accuracy"]
    assert report["summary"] == rl_experiment.compare(report["grpo"], report["rlep"])
    # the committed configs also sample 4 answers per held-out question (avg@4)
    assert report["sampled_summary"] == rl_experiment.compare(report["grpo"], report["rlep"], "sampled_accuracy")
    assert all(c["samples"] == 4 for c in report["grpo"] + report["rlep"])
    assert "avg@4" in (out / "report.md").read_text()
    final = json.loads((out / "final_comparison.json").read_text())
    assert final["samples"] == 2 and set(final["paired"]) == {"grpo", "rlep"}
    assert final["paired"]["rlep"]["all"]["n"] == final["n"] == len(synth_set["test"].read_text().splitlines())
    assert "| RLEP | all (" in (out / "report.md").read_text()
    # RLEP against GRPO, paired on the same questions, from the stored per-question tables
    assert set(final["per_question"]) == {"start", "grpo", "rlep"}
    assert final["versus"]["rlep - grpo"] == rl_experiment.paired(final["per_question"]["grpo"],
                                                                 final["per_question"]["rlep"],
                                                                 {r["id"]: r.get("answer_kind", "?") for r in
                                                                  map(json.loads, synth_set["test"].read_text().splitlines())})
    assert "| RLEP vs GRPO (GRPO -> RLEP) | all (" in (out / "report.md").read_text()
    grpo_cfg = (out / "grpo" / "config.yaml").read_text()
    rlep_cfg = (out / "rlep" / "config.yaml").read_text()
    assert "enabled: false" in grpo_cfg.split("replay:")[1].split("\n\n")[0].split("algorithm:")[0]
    assert str(out / "pool.jsonl") in rlep_cfg
    assert "| RL step | GRPO greedy % | RLEP greedy % | GRPO avg@4 % | RLEP avg@4 % |" in (out / "report.md").read_text()
    # rerunning resumes: every step's output exists, so nothing is recomputed and the report is identical
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "keye train rlep" not in again.stdout
    assert json.loads((out / "report.json").read_text()) == report
