"""Video-MME-style QA (official extraction table, prompt, answered-only denominator) and the synthetic set
evaluator (letter / number rules, per-question-type accuracy, the generator's manifest format)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keye.errors import KeyeInputError
from keye.eval import synth, videoqa
from keye.eval.extract import choice_letter, final_number

VIDEO_MME_CASES = [
    # docs/evaluation.md section 4 table
    ("B", "B"),
    ("The answer is C.", "C"),
    ("Based on the video, the answer is C.", "B"),
    ("Correct option is D", "C"),
    ("(D) Brown.", "D"),
    ("Answer: B", "B"),
    ("E", ""),
    ("I really cannot tell which one is right from these few frames sorry", ""),
    # derived from the rules
    ("The correct answer is (C)", "C"),  # prefix removed first
    ("The best option is D", "D"),  # the fused prefix is never removed: first capital A-D is the D
    ("Best option: A", "B"),  # "Best answer:Best option:" is fused; the B of "Best" comes first
    ("", ""),
    ("d", ""),  # case-sensitive
    ("  A  ", "A"),
    ("one two three four five six seven eight nine ten eleven A", "A"),  # long but holds a letter
    ("The answer D", "D"),
    ("Option: C", "C"),
    ("The correct option A", "A"),
    ("Answer:The best answer is B", "B"),
    ("E or maybe D", "D"),
]


@pytest.mark.parametrize("response, expected", VIDEO_MME_CASES)
def test_video_mme_extraction(response: str, expected: str) -> None:
    assert videoqa.extract_characters_regex(response) == expected


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _vrow(i, answer="A", duration="short", task="Counting", **kw):
    return {
        "id": f"v{i}",
        "video": f"videos/{i}.mp4",
        "question": f"Question {i}?",
        "options": ["A. one", "B. two", "C. three", "D. four"],
        "answer": answer,
        "duration": duration,
        "task_type": task,
        **kw,
    }


def test_videoqa_load_prompt_conversation(tmp_path) -> None:
    path = _write_jsonl(
        tmp_path / "vqa.jsonl", [_vrow(0, subtitles="hello"), dict(_vrow(1), options=["x", "y", "z", "w"])]
    )
    items = videoqa.load_items(path)
    assert items[0]["video"] == str(tmp_path / "videos" / "0.mp4")
    assert videoqa.prompt_text(items[0]) == (
        "Select the best answer to the following multiple-choice question based on the video. "
        "Respond with only the letter (A, B, C, or D) of the correct option.\n"
        "Question 0?\nA. one\nB. two\nC. three\nD. four\nThe best answer is:"
    )
    assert videoqa.prompt_text(items[0], use_subtitles=True).startswith(
        "This video's subtitles are listed below:\nhello\nSelect"
    )
    assert "\nA. x\nB. y\nC. z\nD. w\n" in videoqa.prompt_text(items[1])
    conv = videoqa.build_conversation(items[0], video_options={"fps": 1.0})
    assert conv[0]["content"][0] == {"type": "video", "video": items[0]["video"], "fps": 1.0}


@pytest.mark.parametrize(
    "row, message",
    [
        ({"video": "a.mp4", "question": "q", "options": ["a", "b", "c", "d"]}, "missing 'answer'"),
        (dict(_vrow(0), options=["a", "b"]), "expected 4 options"),
        (dict(_vrow(0), answer="E"), "not A-D"),
    ],
)
def test_videoqa_load_errors(tmp_path, row, message) -> None:
    with pytest.raises(KeyeInputError, match=message):
        videoqa.load_items(_write_jsonl(tmp_path / "bad.jsonl", [row]))


def test_videoqa_load_duplicate_and_bad_json(tmp_path) -> None:
    with pytest.raises(KeyeInputError, match="duplicate"):
        videoqa.load_items(_write_jsonl(tmp_path / "d.jsonl", [_vrow(0), _vrow(0)]))
    (tmp_path / "j.jsonl").write_text("{nope\n")
    with pytest.raises(KeyeInputError, match="line 1"):
        videoqa.load_items(tmp_path / "j.jsonl")


def test_videoqa_scoring_denominators() -> None:
    records = [
        dict(_vrow(0, "A"), response="A"),
        dict(_vrow(1, "B"), response="The answer is C."),
        dict(_vrow(2, "C", duration="long"), response="E"),  # unanswered
        dict(_vrow(3, "D", duration="long", task="OCR"), response="D"),
    ]
    result = videoqa.score_records(records)
    assert result["overall"] == {
        "total": 4,
        "answered": 3,
        "correct": 2,
        "accuracy": 2 / 3,
        "strict_accuracy": 0.5,
    }
    assert result["duration"]["long"] == {
        "total": 2,
        "answered": 1,
        "correct": 1,
        "accuracy": 1.0,
        "strict_accuracy": 0.5,
    }
    assert result["task_type"]["OCR"]["correct"] == 1
    assert result["per_item"]["v2"] == {"extraction": "", "correct": False}


SYNTH_LETTER_CASES = [
    ("B", ["red", "blue", "green"], "B"),
    ("The answer is (C).", ["red", "blue", "green"], "C"),
    ("**A**", ["red", "blue"], "A"),
    ("It is blue.", ["red", "blue", "green"], "B"),
    ("A red circle, so the answer is B", ["red", "blue"], "B"),
    ("A circle moves left.", ["left", "right"], "A"),  # the text "left", not the article A
    ("I would say B is right", ["x", "y", "z"], "B"),  # the only standalone option letter
    ("nothing", ["x", "y"], None),
    ("", ["x"], None),
]


@pytest.mark.parametrize("response, choices, expected", SYNTH_LETTER_CASES)
def test_choice_letter_table(response, choices, expected) -> None:
    assert choice_letter(response, choices) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("3", "3"),
        ("There are 4 shapes.", "4"),
        ("The answer is 2.5 seconds, not 3.", "2.5"),
        ("at 1/2 second", "0.5"),
        ("none", None),
    ],
)
def test_final_number(response, expected) -> None:
    assert final_number(response) == expected


def _srec(i, kind, answer, response, qtype, tolerance=None, choices=None, modality="video"):
    return {
        "id": f"s{i}",
        "answer": answer,
        "answer_kind": kind,
        "question_type": qtype,
        "choices": choices,
        "tolerance": tolerance,
        "modality": modality,
        "response": response,
    }


def test_synth_scoring_per_question_type() -> None:
    records = [
        _srec(0, "mc", "B", "B", "color", choices=["red", "blue"]),
        _srec(1, "mc", "A", "It is blue", "color", choices=["red", "blue"]),
        _srec(2, "numeric", "3", "There are 3 shapes.", "count"),
        _srec(3, "numeric", "2.5", "at 3.0 s", "when_appear", tolerance=0.5),
        _srec(4, "numeric", "2.5", "at 3.5 s", "when_appear", tolerance=0.5),
        _srec(5, "mc", "A", "A", "position", choices=["left", "right"], modality="image"),
    ]
    result = synth.score_records(records)
    assert result["overall"] == {"correct": 4, "total": 6, "accuracy": 4 / 6}
    assert list(result["question_type"]) == ["color", "count", "position", "when_appear"]
    assert result["question_type"]["color"] == {"correct": 1, "total": 2, "accuracy": 0.5}
    assert result["question_type"]["when_appear"]["correct"] == 1  # 0.5 away is within tolerance, 1.0 is not
    assert result["modality"]["image"]["correct"] == 1
    assert result["per_item"]["s1"] == {"prediction": "B", "correct": False}
    with pytest.raises(KeyeInputError, match="answer_kind"):
        synth.score_records([{"id": "x", "answer": "1", "question_type": "count", "response": "1"}])


def test_synth_reads_the_generator_manifest(tmp_path) -> None:
    from keye.data.synth import generate_split

    path = generate_split(tmp_path, "test", 3, seed=1, workers=0, progress=False)
    items = synth.load_items(path)
    assert len(items) == 3
    for item in items:
        assert item["messages"][-1]["role"] == "user"  # the answer turn is dropped
        media = item["messages"][0]["content"][0]
        assert media["type"] in ("image", "video")
        assert Path(media[media["type"]]).is_file()  # resolved against the manifest's directory
        assert item["answer_kind"] in ("mc", "numeric")
    # answering every item with its gold scores 100%
    records = [synth.record_for(it, it["answer"], it["answer"]) for it in items]
    assert synth.score_records(records)["overall"]["accuracy"] == 1.0


def test_synth_load_errors(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(
            {
                "id": "a",
                "messages": [{"role": "user", "content": "q"}],
                "answer": "1",
                "answer_kind": "free",
                "question_type": "x",
            }
        )
        + "\n"
    )
    with pytest.raises(KeyeInputError, match="answer_kind"):
        synth.load_items(bad)
    bad.write_text("{oops\n")
    with pytest.raises(KeyeInputError, match="malformed"):
        synth.load_items(bad)


def test_synth_majority_baseline_per_type_with_tolerance() -> None:
    recs = [
        {"id": "1", "answer": "B", "answer_kind": "mc", "question_type": "color", "response": "B"},
        {"id": "2", "answer": "B", "answer_kind": "mc", "question_type": "color", "response": "A"},
        {"id": "3", "answer": "A", "answer_kind": "mc", "question_type": "color", "response": "A"},
        # numeric: the most common answer (2.0) is also within tolerance of 2.5
        {"id": "4", "answer": "2.0", "answer_kind": "numeric", "question_type": "when", "tolerance": 0.5, "response": "0"},
        {"id": "5", "answer": "2.0", "answer_kind": "numeric", "question_type": "when", "tolerance": 0.5, "response": "0"},
        {"id": "6", "answer": "2.5", "answer_kind": "numeric", "question_type": "when", "tolerance": 0.5, "response": "0"},
        {"id": "7", "answer": "4.0", "answer_kind": "numeric", "question_type": "when", "tolerance": 0.5, "response": "0"},
    ]
    base = synth.majority_baseline(recs)
    assert base["answer"] == {"color": "B", "when": "2.0"}
    assert base["question_type"]["color"]["correct"] == 2 and base["question_type"]["when"]["correct"] == 3
    assert base["overall"] == {"correct": 5, "total": 7, "accuracy": 5 / 7}
    result = synth.score_records(recs)
    assert result["majority"] == base
    from keye.eval.report import synth_report

    overall, tables = synth_report(result)
    assert overall["majority %"] == pytest.approx(100 * 5 / 7, abs=0.01)
    assert {r["question_type"]: r["majority %"] for r in tables["question_type"]} == {"color": pytest.approx(66.67, abs=0.01), "when": 75.0}
    assert "majority" not in tables


def test_synth_blank_items_keep_size_rate_and_length(tmp_path) -> None:
    import av
    import numpy as np
    from PIL import Image

    from keye.data.synth import BACKGROUND, generate_split

    manifest = generate_split(tmp_path / "s", "test", 6, seed=1, workers=0, progress=False, image_fraction=0.5)
    items = synth.load_items(manifest)
    blank = synth.blank_items(items, tmp_path / "blank")
    kinds = set()
    for a, b in zip(items, blank):
        assert a["answer"] == b["answer"] and a["messages"] is not b["messages"]
        (ca,), (cb,) = ([c for c in m["content"] if c.get("type") in ("image", "video")] for m in (a["messages"][0], b["messages"][0]))
        kind = ca["type"]
        kinds.add(kind)
        assert ca[kind] != cb[kind] and Path(cb[kind]).parent == tmp_path / "blank"
        texts = [[c for c in m["content"] if c.get("type") == "text"] for m in (a["messages"][0], b["messages"][0])]
        assert texts[0] == texts[1]
        if kind == "image":
            with Image.open(ca[kind]) as x, Image.open(cb[kind]) as y:
                assert x.size == y.size and set(y.getdata()) == {BACKGROUND}
            continue
        with av.open(ca[kind]) as x, av.open(cb[kind]) as y:
            sx, sy = x.streams.video[0], y.streams.video[0]
            assert (sx.codec_context.width, sx.codec_context.height) == (sy.codec_context.width, sy.codec_context.height)
            assert sx.average_rate == sy.average_rate
            fx = [f.to_ndarray(format="rgb24") for f in x.decode(video=0)]
            fy = [f.to_ndarray(format="rgb24") for f in y.decode(video=0)]
        assert len(fx) == len(fy)
        assert max(np.abs(f.astype(int) - np.array(BACKGROUND)).max() for f in fy) <= 3  # yuv420 round trip
        assert max(np.abs(f.astype(int) - np.array(BACKGROUND)).max() for f in fx) > 50  # the real clip has objects
    assert kinds == {"image", "video"}
    bad = dict(items[0], id="bad", messages=[{"role": "user", "content": [{"type": "video", "video": str(tmp_path / "missing.mp4")}, {"type": "text", "text": "q"}]}])
    with pytest.raises(KeyeInputError, match="missing.mp4"):
        synth.blank_items([bad], tmp_path / "blank")
