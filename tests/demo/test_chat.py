"""``keye chat``: streamed one-shot answers, the interactive loop and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from keye.demo import chat
from keye.demo.session import ChatSession, VideoSettings


def test_one_shot_answer_equals_greedy_generate(tiny_ckpt, clip, capsys):
    rc = chat.main(
        [
            "--model",
            str(tiny_ckpt),
            "--video",
            str(clip),
            "Which way does it move?",
            "--max-new-tokens",
            "8",
            "--device",
            "cpu",
            "--json",
        ]
    )
    assert rc == 0
    parsed = json.loads(capsys.readouterr().out)

    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor

    proc = KeyeProcessor.from_pretrained(tiny_ckpt)
    model = KeyeVL.from_pretrained(tiny_ckpt, torch_dtype="float32")
    msgs = ChatSession(media=[("video", str(clip))]).messages(
        "Which way does it move?", VideoSettings(None, None, None, None, None)
    )
    batch = proc(msgs)
    out = model.generate(**batch, max_new_tokens=8, do_sample=False)
    expected = proc.decode(out[0, batch["input_ids"].shape[1] :])
    assert parsed["raw"] == expected
    assert parsed["raw"].strip()


def test_streamed_text_is_printed(tiny_ckpt, clip, capsys):
    assert (
        chat.main(
            ["--model", str(tiny_ckpt), "--video", str(clip), "What is shown?", "--max-new-tokens", "6"]
        )
        == 0
    )
    assert capsys.readouterr().out.strip()


def test_interactive_multi_turn(tiny_ckpt, clip, capsys, monkeypatch):
    lines = iter(["What is shown?", "And then?", "/reset", "Colour?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    lengths = []
    original = ChatSession.messages

    def spy(self, question, video=None):
        msgs = original(self, question, video)
        lengths.append(len(msgs))
        return msgs

    monkeypatch.setattr(ChatSession, "messages", spy)
    assert chat.main(["--model", str(tiny_ckpt), "--video", str(clip), "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.count("keye> ") == 3
    assert lengths == [1, 3, 1]  # the second question sees the first turn; /reset forgets it


@pytest.mark.parametrize(
    "args, message",
    [
        (["--video", "/nonexistent/dir/missing.mp4", "q"], "keye chat: error: missing.mp4: file not found"),
        (["--image", "notes.txt", "q"], "keye chat: error: notes.txt: unsupported file type '.txt'"),
        (["--temperature", "0", "--sample", "q"], "keye chat: error: temperature must be > 0"),
    ],
)
def test_bad_input_is_one_line_exit_1(args, message, capsys):
    assert chat.main(args) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_bad_path_from_a_real_process():
    r = subprocess.run(
        [sys.executable, "-m", "keye.demo.chat", "--video", "missing.mp4", "q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.strip() == "keye chat: error: missing.mp4: file not found", r.stderr
