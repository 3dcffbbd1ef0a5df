"""``keye eval`` commands end to end with a fake engine on tiny local sets, and the thin scripts."""

from __future__ import annotations

import json
import subprocess
import sys

from keye.cli import build_parser, main
from keye.eval import cli as eval_cli
from tests.paths import REPO_ROOT

from .conftest import CannedEngine

MMMU_ANSWERS = {
    "Which colour": "<think>it looks red</think>\n\n(A)",  # gold A: correct
    "Compare": "B",  # gold B: correct
    "How many squares": "The answer is 1",  # open, gold 1: correct
    "What is 2+2": "(C)",  # gold B: wrong
    "Area of the square": "x = 9",  # open, gold 9: correct
    "Pick the prime": "???",  # unparseable: first seeded draw is A, gold C: wrong
}


def _mmmu_answer(text: str) -> str:
    return next(a for key, a in MMMU_ANSWERS.items() if key in text)


def test_eval_mmmu_with_fake_engine(mmmu_dir, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    args = build_parser().parse_args(
        [
            "eval",
            "mmmu",
            "--model",
            "fake",
            "--data",
            str(mmmu_dir),
            "--out",
            str(out),
            "--batch-size",
            "4",
            "--no-progress",
        ]
    )
    engine = CannedEngine(_mmmu_answer)
    assert eval_cli.cmd_mmmu(args, engine=engine) == 0
    assert engine.calls == [4, 2]
    scores = json.loads((out / "scores.json").read_text())
    assert scores["Art"] == {"num": 3, "acc": 1.0}
    assert scores["Math"] == {"num": 3, "acc": 0.333}
    assert scores["Overall-Science"] == {"num": 3, "acc": 0.333}
    assert scores["Overall"] == {"num": 6, "acc": 0.667}
    judgements = {j["id"]: j for j in map(json.loads, (out / "judgements.jsonl").read_text().splitlines())}
    assert judgements["validation_Math_3"]["parsed_pred"] == "A"
    report = json.loads((out / "report.json").read_text())
    assert report["model_id"] == "fake" and report["config"]["prompt_style"] == "mmmu"
    assert report["overall"] == {"correct": 4, "num": 6, "acc": 0.667}
    md = (out / "report.md").read_text()
    assert "| Art | 3 | 3 | 1.0 |" in md and "- split: `validation`" in md
    preds = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert preds[0]["response"] == "(A)" and preds[0]["raw_output"].startswith("<think>")
    # Running again resumes: nothing left to answer, same scores.
    again = CannedEngine(_mmmu_answer)
    assert eval_cli.cmd_mmmu(args, engine=again) == 0
    assert again.calls == []
    assert json.loads((out / "scores.json").read_text()) == scores
    # And the stored predictions re-score to the same numbers.
    assert main(["eval", "score", "mmmu", str(out / "predictions.jsonl")]) == 0
    assert "| 4 | 6 | 0.667 |" in capsys.readouterr().out


MATHVISTA_ANSWERS = {
    "largest angle": "The answer is (C)",  # 145°: correct
    "How many bars": "15",  # gold 14: wrong
    "length of the side": "It is about 1.25 cm",  # rule extraction 1.25 -> 1.2: correct
    "two years": "[2014,2016]",  # rule extraction re-joins as [2014, 2016]: correct
}


def test_eval_mathvista_with_fake_engine(mathvista_dir, tmp_path) -> None:
    out = tmp_path / "run"
    args = build_parser().parse_args(
        [
            "eval",
            "mathvista",
            "--model",
            "fake",
            "--data",
            str(mathvista_dir),
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert (
        eval_cli.cmd_mathvista(
            args, engine=CannedEngine(lambda t: next(a for k, a in MATHVISTA_ANSWERS.items() if k in t))
        )
        == 0
    )
    scores = json.loads((out / "scores.json").read_text())
    assert scores["average"] == {"accuracy": 0.75, "correct": 3, "total": 4}
    assert scores["answer_type"]["integer"]["correct"] == 0
    assert scores["language"] == {
        "chinese": {"accuracy": 1.0, "correct": 1, "total": 1},
        "english": {"accuracy": 2 / 3, "correct": 2, "total": 3},
    }
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["extractor"] == "rules"
    judgements = [json.loads(line) for line in (out / "judgements.jsonl").read_text().splitlines()]
    # "(C)" opens the answer tail, so the letter itself is the extraction
    assert [j["extraction"] for j in judgements] == ["C", "15", "1.25", "[2014, 2016]"]


def test_eval_videoqa_and_synth_with_fake_engine(tmp_path) -> None:
    rows = [
        {
            "id": f"v{i}",
            "video": f"{i}.mp4",
            "question": f"Q{i}",
            "options": ["a", "b", "c", "d"],
            "answer": ans,
            "duration": dur,
        }
        for i, (ans, dur) in enumerate([("A", "short"), ("B", "short"), ("C", "long")])
    ]
    data = tmp_path / "vqa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "vrun"
    args = build_parser().parse_args(
        [
            "eval",
            "videoqa",
            "--model",
            "fake",
            "--data",
            str(data),
            "--out",
            str(out),
            "--fps",
            "1",
            "--no-progress",
        ]
    )
    answers = {
        "Q0": "A",
        "Q1": "The answer is C",
        "Q2": "no idea at all, the frames are far too dark to see anything",
    }
    assert (
        eval_cli.cmd_videoqa(
            args, engine=CannedEngine(lambda t: next(a for k, a in answers.items() if k in t))
        )
        == 0
    )
    result = json.loads((out / "scores.json").read_text())
    assert result["overall"]["correct"] == 1 and result["overall"]["answered"] == 2
    assert result["duration"]["long"]["answered"] == 0
    assert json.loads((out / "report.json").read_text())["config"]["fps"] == 1.0
    rescored = tmp_path / "rescored"
    assert main(["eval", "score", "videoqa", str(out / "predictions.jsonl"), "--out", str(rescored)]) == 0
    assert json.loads((rescored / "scores.json").read_text()) == result

    from keye.data.synth import generate_split
    from keye.eval import synth

    manifest = generate_split(tmp_path / "synth", "test", 4, seed=3, workers=0, progress=False)
    out_s = tmp_path / "srun"
    args = build_parser().parse_args(
        ["eval", "synth", "--model", "fake", "--data", str(manifest), "--out", str(out_s), "--no-progress"]
    )
    assert eval_cli.cmd_synth(args, engine=CannedEngine(lambda t: "A")) == 0
    items = synth.load_items(manifest)
    expected = sum(it["answer"] == "A" for it in items)  # "A" is right exactly for mc items whose gold is A
    result = json.loads((out_s / "scores.json").read_text())
    assert result["overall"] == {"correct": expected, "total": 4, "accuracy": expected / 4}
    assert sum(r["total"] for r in result["question_type"].values()) == 4
    assert (
        main(["eval", "score", "synth", str(out_s / "predictions.jsonl"), "--out", str(tmp_path / "s2")]) == 0
    )
    assert json.loads((tmp_path / "s2" / "scores.json").read_text()) == result


def test_score_errors_and_help(tmp_path, capsys) -> None:
    preds = tmp_path / "p.json"
    preds.write_text(json.dumps({"validation_Art_1": "A"}))
    assert main(["eval", "score", "mmmu", str(preds)]) == 1
    assert "--answers" in capsys.readouterr().err
    assert main(["eval", "score", "mathvista", str(tmp_path / "missing.jsonl")]) == 1
    assert "not found" in capsys.readouterr().err
    assert main(["eval"]) == 2


def test_thin_script_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "eval" / "video_qa.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "--subtitles" in result.stdout
