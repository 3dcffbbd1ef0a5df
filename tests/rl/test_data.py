"""RL prompts from a manifest: user turns only, reference/task/extras carried over, bad rows reported."""

from __future__ import annotations

import json

import pytest

from keye.errors import KeyeInputError
from keye.rl.rollout.prompts import load_rl_prompts


def test_manifest_rows_become_prompts(tmp_path):
    rows = [
        {"id": "a", "messages": [{"role": "user", "content": "how many?"},
                                 {"role": "assistant", "content": "3"}],
         "answer": "3", "answer_kind": "numeric", "tolerance": 0.5, "mode": "think"},
        {"id": "b", "messages": [{"role": "user", "content": [{"type": "image", "image": "img.png"},
                                                              {"type": "text", "text": "colour?"}]}],
         "answer": "B", "answer_kind": "mc", "choices": ["red", "blue"]},
    ]
    path = tmp_path / "rl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = load_rl_prompts(path)
    assert a.id == "a" and a.messages == [{"role": "user", "content": "how many?"}]
    assert (a.reference, a.task, a.mode, a.extra) == ("3", "numeric", "think", {"tolerance": 0.5})
    assert b.messages[0]["content"][0]["image"] == str(tmp_path / "img.png")  # resolved against the manifest
    assert b.extra == {"choices": ["red", "blue"]} and b.mode is None


def test_bad_rows(tmp_path):
    path = tmp_path / "rl.jsonl"
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\nnot json\n')
    with pytest.raises(KeyeInputError, match="line 2"):
        load_rl_prompts(path)
    assert [p.id for p in load_rl_prompts(path, strict=False)] == ["a"]
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "x"}], "mode": "deep"}\n')
    with pytest.raises(KeyeInputError, match="mode"):
        load_rl_prompts(path)
