"""The detail probe (training/probe_detail.py): the scene it rebuilds is the manifest row's, and its
measurements follow the processor's slow/fast split and sizes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from keye.data.synth import make_sample, sample_scene

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("probe_detail", REPO / "training/probe_detail.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


@pytest.fixture(scope="module")
def processor():
    proc = probe.load_processor("keye-tiny")
    # the budget the sizes below assume (stage 2's; the installed model may keep a bigger one from stage 3)
    proc.override_preprocessor({"max_pixels": 12544, "video_defaults": {"max_pixels": 12544}})
    return proc


def _detail_index(seed: int, width: int) -> int:
    for i in range(200):
        s = sample_scene(seed, "test", i)
        if s.question_type == "detail" and s.width == s.height == width:
            return i
    raise AssertionError("no square detail scene in 200 samples")


def test_sample_scene_is_the_scene_of_the_manifest_row(tmp_path):
    for i in range(12):
        scene = sample_scene(3, "test", i)
        row = make_sample(str(tmp_path), "test", i, 3, 0.1)
        assert (row["question_type"], row["answer"], row["meta"]["events"]) == (
            scene.question_type, scene.answer, scene.events)
        assert row["messages"][0]["content"][1]["text"] == scene.question


def test_a_key_frame_shows_the_tiny_shape_at_its_budgeted_size(tmp_path, processor):
    i = _detail_index(0, 112)  # 112 x 112 fits the 12,544-pixel budget: key frames keep their size
    scene = sample_scene(0, "test", i)
    tiny = next(o for o in scene.objects if o.color == "white")
    strict = probe.probe_scene(scene, processor, tmp_path, {"slow_fast": False})
    assert strict["slow_seen"] and strict["seen_hw"] == [112, 112]
    assert strict["diameter_px"] == pytest.approx(2 * tiny.size, abs=0.01)
    assert strict["frames_showing"] == 2 and strict["key_frames"] == strict["frames"]  # 1 s at 2 fps
    default = probe.probe_scene(scene, processor, tmp_path)
    assert default["key_frames"] <= strict["key_frames"]
    ratio = default["seen_hw"][0] / default["source_hw"][0]
    assert default["diameter_px"] == pytest.approx(2 * tiny.size * ratio, abs=0.01)
    if not default["slow_seen"]:  # a fast frame is budgeted at 30 % of a key frame's tokens
        assert default["diameter_px"] < strict["diameter_px"]
    other = next(s for s in (sample_scene(0, "test", j) for j in range(50)) if s.question_type != "detail")
    with pytest.raises(ValueError, match="not a detail scene"):
        probe.probe_scene(other, processor, tmp_path)


def test_summary_splits_by_key_frame_and_scores_the_judged():
    recs = [{"slow_seen": True, "diameter_px": 10.0, "tokens_of_frame": 12, "correct": True},
            {"slow_seen": False, "diameter_px": 4.0, "tokens_of_frame": 2, "correct": False},
            {"slow_seen": False, "diameter_px": 6.0, "tokens_of_frame": 4, "correct": True},
            {"slow_seen": False, "diameter_px": 5.0, "tokens_of_frame": 2}]
    s = probe.summarise(recs)
    assert s["all"] == {"n": 4, "median_diameter_px": 5.5, "median_tokens_of_frame": 3.0, "accuracy": 66.7}
    assert s["seen in a key frame"]["accuracy"] == 100.0 and s["fast frames only"]["accuracy"] == 50.0
    assert s["fast frames only"]["median_diameter_px"] == 5.0


def test_main_joins_an_eval_and_writes_the_report(tmp_path, capsys):
    ids = [f"test-{i:06d}" for i in range(40) if sample_scene(5, "test", i).question_type == "detail"]
    assert ids
    ev = tmp_path / "eval"
    ev.mkdir()
    (ev / "judgements.jsonl").write_text("".join(json.dumps({"id": k, "correct": j == 0}) + "\n"
                                                 for j, k in enumerate(ids)))
    assert probe.main(["--seed", "5", "--n", "40", "--eval", str(ev), "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "detail_probe.json").read_text())
    assert [r["id"] for r in report["records"]] == ids
    assert report["summary"]["all"]["accuracy"] == round(100 / len(ids), 1)
    installed = probe.load_processor("keye-tiny").image_processor.config.video_defaults
    assert report["video_defaults"] == installed  # measured as keye-tiny sees its clips
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"detail clips {len(ids)}:")
    with pytest.raises(SystemExit, match="judgements.jsonl"):
        probe.main(["--seed", "5", "--n", "4", "--eval", str(tmp_path / "nope")])
