"""The demo's bundled example clips: chosen by a rule that ignores the model, committed as rendered, and
answered correctly by the installed keye-tiny (they are what a newcomer tries first)."""

from __future__ import annotations

import json

import pytest

from keye.demo.examples import (
    EXAMPLE_TYPES,
    REPO_EXAMPLES,
    answer_examples,
    load_examples,
    shows_its_events,
    write_examples,
)


@pytest.mark.parametrize(
    ("meta", "ok"),
    [
        ({"modality": "video", "duration": 8.0, "events": [{"t": 3.5}]}, True),
        ({"modality": "video", "duration": 4.0, "events": [{"t": 1.0}, {"t": 3.0}]}, True),
        ({"modality": "video", "duration": 8.0, "events": [{"t": 0.5}]}, False),  # too early to see before
        ({"modality": "video", "duration": 5.0, "events": [{"t": 2.0}, {"t": 4.5}]}, False),  # too late
        ({"modality": "video", "duration": 3.5, "events": [{"t": 1.5}]}, False),  # too short
        ({"modality": "video", "duration": 6.0, "events": []}, True),
        ({"modality": "image", "duration": 6.0, "events": []}, False),
    ],
)
def test_an_example_shows_the_scene_before_and_after_its_events(meta, ok):
    assert shows_its_events(meta) is ok


def test_committed_examples_are_what_the_rule_renders(tmp_path):
    rows = write_examples(tmp_path)
    assert [r["question_type"] for r in rows] == list(EXAMPLE_TYPES)
    committed = json.loads((REPO_EXAMPLES / "examples.json").read_text())
    assert committed == rows, "demo/examples is stale: run `python demo/make_examples.py`"
    for r in rows:
        assert (REPO_EXAMPLES / r["video"]).stat().st_size > 0


def test_keye_tiny_answers_every_example():
    from keye.tiny import tiny_dir

    answers = answer_examples(tiny_dir())
    assert [a["question_type"] for a in answers] == list(EXAMPLE_TYPES)
    assert all(a["correct"] for a in answers), answers


def _wrong(row):
    if row["answer_kind"] == "numeric":
        return str(int(row["answer"]) + 1)
    return next(c for c in row["choices"] if c != row["answer"])


def test_a_wrong_answer_is_scored_wrong():
    """The scoring can fail: the same clips with every answer moved to another candidate."""
    from keye.tiny import tiny_dir

    rows = [{**r, "answer": _wrong(r)} for r in load_examples()]
    assert not any(a["correct"] for a in answer_examples(tiny_dir(), rows))


def test_the_think_example_shows_a_trace_and_the_others_none():
    from keye.demo.examples import THINK_EXAMPLES
    from keye.tiny import tiny_dir

    for a in answer_examples(tiny_dir()):
        assert bool(a["think"]) is (a["question_type"] in THINK_EXAMPLES), a
