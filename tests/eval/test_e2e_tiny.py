"""End to end: a tiny random Keye-VL checkpoint answers tiny local MMMU-, MathVista- and Video-MME-format sets
through ``keye eval``; the runs complete, resume, and write predictions, scores and reports."""

from __future__ import annotations

import json

import pytest

from keye.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from keye.testing.model import save_tiny_checkpoint
    from keye.testing.processor import make_tiny_processor_dir

    directory = tmp_path_factory.mktemp("tiny")
    save_tiny_checkpoint(directory)
    make_tiny_processor_dir(directory, vocab_size=512)
    return directory


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tiny_mmmu_run_and_resume(tiny_checkpoint, mmmu_dir, tmp_path) -> None:
    out = tmp_path / "mmmu"
    argv = ["eval", "mmmu", "--model", str(tiny_checkpoint), "--data", str(mmmu_dir), "--out", str(out)]
    argv += ["--max-new-tokens", "4", "--batch-size", "3", "--mode", "think", "--no-progress"]
    assert main(argv) == 0
    preds = _lines(out / "predictions.jsonl")
    assert len(preds) == 6 and all(isinstance(p["raw_output"], str) for p in preds)
    scores = json.loads((out / "scores.json").read_text())
    assert scores["Overall"]["num"] == 6 and 0.0 <= scores["Overall"]["acc"] <= 1.0
    report = json.loads((out / "report.json").read_text())
    assert report["model_id"] == str(tiny_checkpoint) and report["config"]["mode"] == "think"
    assert (out / "report.md").read_text().startswith("# mmmu evaluation")
    # a second run finds every id answered and leaves the predictions untouched
    assert main(argv) == 0
    assert _lines(out / "predictions.jsonl") == preds


def test_tiny_mathvista_greedy_batch_invariant(tiny_checkpoint, mathvista_dir, tmp_path) -> None:
    outputs = []
    for name, batch in (("a", "1"), ("b", "4")):  # batched (left-padded) and one by one agree
        out = tmp_path / name
        argv = [
            "eval",
            "mathvista",
            "--model",
            str(tiny_checkpoint),
            "--data",
            str(mathvista_dir),
            "--out",
            str(out),
        ]
        assert main(argv + ["--max-new-tokens", "4", "--batch-size", batch, "--no-progress"]) == 0
        outputs.append([p["raw_output"] for p in _lines(out / "predictions.jsonl")])
        scores = json.loads((out / "scores.json").read_text())
        assert scores["average"]["total"] == 4
        assert (out / "report.md").is_file()
    assert outputs[0] == outputs[1]


def test_tiny_videoqa_on_a_real_clip(tiny_checkpoint, tmp_path) -> None:
    from keye.testing.processor import make_test_video

    make_test_video(tmp_path / "clip.mp4", n_frames=8, fps=4.0, size=(56, 56))
    row = {
        "id": "c1",
        "video": "clip.mp4",
        "question": "What is shown?",
        "options": ["a", "b", "c", "d"],
        "answer": "A",
        "duration": "short",
    }
    data = tmp_path / "vqa.jsonl"
    data.write_text(json.dumps(row) + "\n")
    out = tmp_path / "run"
    argv = ["eval", "videoqa", "--model", str(tiny_checkpoint), "--data", str(data), "--out", str(out)]
    assert main(argv + ["--max-new-tokens", "3", "--fps", "2", "--no-progress"]) == 0
    result = json.loads((out / "scores.json").read_text())
    assert result["overall"]["total"] == 1


@pytest.mark.parametrize("bench", ["mmmu", "mathvista"])
def test_keye_tiny_alias_runs_the_benchmarks(bench, mmmu_dir, mathvista_dir, tmp_path) -> None:
    """The embedded default answers the tiny MMMU- and MathVista-format sets and writes the reports."""
    data = mmmu_dir if bench == "mmmu" else mathvista_dir
    out = tmp_path / bench
    argv = ["eval", bench, "--model", "keye-tiny", "--data", str(data), "--out", str(out),
            "--max-new-tokens", "6", "--batch-size", "4", "--no-progress"]
    assert main(argv) == 0
    assert _lines(out / "predictions.jsonl")
    assert (out / "report.md").is_file() and (out / "report.json").is_file()
    assert json.loads((out / "report.json").read_text())["model_id"] == "keye-tiny"
