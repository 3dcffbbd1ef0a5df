"""Free-form wordings, thinking-mode rows and greetings of the synthetic set (keye.data.synth_forms), and the
``text`` answer kind that scores free-form replies."""

from __future__ import annotations

import json

import pytest

from keye.data.synth import COLORS, LETTERS, VIDEO_TYPES, generate_split
from keye.data.synth_answers import extract, is_correct, named_candidate
from keye.data.synth_forms import (
    FREE_TYPES,
    FREE_WORDINGS,
    GREETING_TRACE,
    forms_rows,
    free_form_row,
    greeting_rows,
    mode_row,
)
from keye.eval.synth import load_items, score_records


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("forms")
    # Half images so the image-only position type shows up; 60 clips hold every default type.
    generate_split(out, "train", 60, seed=5, image_fraction=0.4, modes=True, places=True, workers=1,
                   progress=False)
    return out, [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def test_every_default_type_has_a_free_wording():
    assert set(VIDEO_TYPES) | {"position"} == FREE_TYPES


def test_free_rows_drop_the_options_and_keep_the_answer(rows):
    _, source = rows
    seen = set()
    for row in source:
        free = free_form_row(row)
        question = free["messages"][0]["content"][-1]["text"]
        assert "Options" not in question and "Answer with" not in question and "(in seconds)" not in question
        assert "\n" not in question and question.endswith("?")
        assert free["id"] == f"{row['id']}-free" and free["form"] == "free"
        assert free["messages"][1] == row["messages"][1]  # the trained reply is the same word
        assert free["messages"][0]["content"][0] == row["messages"][0]["content"][0]  # same clip
        if row["answer_kind"] == "mc":
            target = row["choices"][LETTERS.index(row["answer"])]
            assert free["answer_kind"] == "text" and free["answer"] == target and target in free["choices"]
            if row["question_type"] in ("color", "color_change"):
                assert free["choices"] == list(COLORS)  # every colour, not the four hidden options
        else:
            assert free["answer_kind"] == "numeric" and free["answer"] == row["answer"]
        seen.add(row["question_type"])
    assert {"color", "direction", "order", "count", "position"} <= seen


def test_wording_is_a_function_of_the_row(rows):
    _, source = rows
    row = next(r for r in source if r["question_type"] == "direction")
    assert free_form_row(row) == free_form_row(json.loads(json.dumps(row)))
    texts = {free_form_row(row, k)["messages"][0]["content"][-1]["text"] for k in range(4)}
    assert len(texts) == len(FREE_WORDINGS["direction"])
    assert any(t.startswith("Which way does the ") for t in texts)


def test_free_form_rejects_rows_it_cannot_reword(rows):
    _, source = rows
    row = json.loads(json.dumps(source[0]))
    row["question_type"] = "when_sum"
    with pytest.raises(ValueError, match="no free-form wording"):
        free_form_row(row)
    row = json.loads(json.dumps(next(r for r in source if r["question_type"] == "color")))
    row["messages"][0]["content"][-1]["text"] = "Tell me about the clip."
    with pytest.raises(ValueError, match="is not a color question"):
        free_form_row(row)


@pytest.mark.parametrize(("reply", "expected"), [
    ("right", "right"), ("It moves right.", "right"), ("Right", "right"), ("left, no, right", "right"),
    ("brightness", None), ("", None), ("<think>moves left</think>right", "right"),
])
def test_named_candidate_reads_the_last_whole_word(reply, expected):
    assert named_candidate(reply, ["left", "right", "up", "down"]) == expected


def test_text_answers_score_by_the_candidate_named_last():
    item = {"answer_kind": "text", "answer": "the red circle",
            "choices": ["the red circle", "the red square", "the blue circle"]}
    for reply, ok in (("the red circle", True), ("red circle", True), ("The Red Circle.", True),
                      ("the red square", False), ("the blue circle", False), ("a circle", False)):
        assert is_correct(extract(reply, item), item) is ok, reply
    colour = {"answer_kind": "text", "answer": "red", "choices": list(COLORS)}
    # A colour outside any four-option list is still a named, wrong answer.
    assert extract("white", colour) == "white" and not is_correct("white", colour)


def test_free_form_manifest_evaluates(rows, tmp_path):
    out, source = rows
    manifest = out / "free.jsonl"
    manifest.write_text("".join(json.dumps(free_form_row(r)) + "\n" for r in source))
    items = load_items(manifest)
    assert {it["answer_kind"] for it in items} == {"text", "numeric"}
    records = [{**it, "response": it["answer"]} for it in items]
    assert score_records(records)["overall"]["accuracy"] == 1.0


def test_mode_rows_switch_the_prompt_and_the_target(rows):
    _, source = rows
    row = next(r for r in source if r["question_type"] == "count")
    think, direct = mode_row(row, "think"), mode_row(free_form_row(row), "no_think")
    assert think["messages"][0]["content"][-1]["text"].endswith("/think")
    reply = think["messages"][1]["content"][0]["text"]
    assert reply.startswith("<think>") and reply.endswith(f"</think>{row['messages'][1]['content'][0]['text']}")
    assert reply == row["modes"]["think"]
    assert direct["messages"][0]["content"][-1]["text"].endswith("/no_think")
    assert direct["messages"][1]["content"][0]["text"] == row["answer"] and direct["id"].endswith("-free-no_think")
    with pytest.raises(ValueError, match="think"):
        mode_row(row, "auto")


def test_greetings_are_text_only_with_a_reply_and_a_trace():
    rows = greeting_rows(30, seed=1)
    assert rows == greeting_rows(30, seed=1) and len({r["id"] for r in rows}) == 30
    for r in rows:
        user, reply = r["messages"]
        assert [p["type"] for p in user["content"]] == ["text"] and "answer" not in r
        assert r["modes"]["think"] == f"<think>{GREETING_TRACE}</think>{reply['content'][0]['text']}"


def test_forms_rows_ask_each_clip_three_ways(rows):
    _, source = rows
    out = forms_rows(source, greetings=10)
    ids = [r["id"] for r in out]
    assert len(ids) == len(set(ids)) == 3 * len(source) + 20
    modes = [r for r in out if r.get("mode")]
    assert {r["mode"] for r in modes} == {"think", "no_think"}
    assert sum(r["mode"] == "think" for r in modes) > sum(r["mode"] == "no_think" for r in modes)
    assert all("modes" not in r and "caption" not in r for r in out)
