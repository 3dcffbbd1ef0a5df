"""Manifest parsing: every malformed row is reported with its line number, valid rows resolve paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keye.data.manifest import read_manifest, write_manifest
from keye.errors import KeyeInputError


def _video_row(path: str, **extra) -> dict:
    return {
        "messages": [
            {"role": "user", "content": [{"type": "video", "video": path, "fps": 2.0}, {"type": "text", "text": "q"}]},
            {"role": "assistant", "content": "a"},
        ],
        **extra,
    }


def test_bad_rows_reported_with_lines(tmp_path: Path):
    lines = [
        json.dumps(_video_row("clips/a.mp4", id="a")),  # 1 ok
        "{not json",  # 2
        json.dumps({"id": "b"}),  # 3 no messages
        json.dumps({"messages": [{"role": "robot", "content": "hi"}]}),  # 4 bad role
        json.dumps({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "x"}]}]}),  # 5
        "",  # blank lines are ignored
        json.dumps(_video_row("clips/a.mp4", id="a")),  # 7 duplicate id
        json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}]}]}),  # 8 no path
        json.dumps({"messages": [{"role": "assistant", "content": "only"}]}),  # 9 no user turn
        json.dumps([1, 2]),  # 10 not an object
        json.dumps({"messages": [{"role": "user", "content": [{"image": "/abs/x.png"}, "text"]}]}),  # 11
    ]
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(lines) + "\n")
    man = read_manifest(p)
    assert [s.line for s in man.samples] == [1]
    got = {b.line: b.reason for b in man.bad_rows}
    assert sorted(got) == [2, 3, 4, 5, 7, 8, 9, 10, 11]
    assert "invalid JSON" in got[2]
    assert "messages" in got[3]
    assert "'robot'" in got[4]
    assert "'audio'" in got[5]
    assert "duplicate id 'a'" in got[7] and "line 1" in got[7]
    assert "no path" in got[8]
    assert "no user turn" in got[9]
    assert "list" in got[10]
    assert "content[1]" in got[11]


def test_paths_resolved_against_root_and_options_kept(tmp_path: Path):
    p = tmp_path / "sub" / "m.jsonl"
    write_manifest(
        p,
        [
            _video_row("clips/a.mp4"),
            {"messages": [{"role": "user", "content": [{"image": "file:///abs/x.png"}, {"type": "text", "text": "t"}]}]},
            {"messages": [{"role": "user", "content": [{"type": "video", "video": ["f0.jpg", "f1.jpg"]}]}]},
            {"messages": [{"role": "user", "content": "just text"}], "group": 7},
        ],
    )
    man = read_manifest(p)
    assert not man.bad_rows
    a, b, c, d = man.samples
    assert a.media[0].path == str(tmp_path / "sub" / "clips" / "a.mp4")
    assert a.messages[0]["content"][0]["video"] == a.media[0].path
    assert a.media[0].options == {"fps": 2.0}
    assert b.media[0].kind == "image" and b.media[0].path == "/abs/x.png"
    assert c.media[0].frames == (str(tmp_path / "sub" / "f0.jpg"), str(tmp_path / "sub" / "f1.jpg"))
    assert [s.modality for s in man.samples] == ["video", "image", "video", "text"]
    assert d.group == "7" and a.group is None
    assert [s.id for s in man.samples] == ["line-1", "line-2", "line-3", "line-4"]
    other_root = read_manifest(p, root=tmp_path)
    assert other_root.samples[0].media[0].path == str(tmp_path / "clips" / "a.mp4")


def test_missing_manifest_raises_typed_error(tmp_path: Path):
    with pytest.raises(KeyeInputError, match="manifest file not found"):
        read_manifest(tmp_path / "nope.jsonl")
