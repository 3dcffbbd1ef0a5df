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
        (["--image", "clip.mp4", "q"], "keye chat: error: clip.mp4: given with --image, but a .mp4 file is a video; "
                                        "pass it with --video"),
        (["--video", "still.PNG", "q"], "keye chat: error: still.PNG: given with --video, but a .png file is an image; "
                                        "pass it with --image"),
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


def test_a_declared_kind_with_an_unknown_extension_is_checked_by_content(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a picture")
    assert chat.main(["--image", str(notes), "q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("keye chat: error: notes.txt: not an image Pillow can read"), err
    from PIL import Image

    from keye.demo.session import check_media

    Image.new("RGB", (8, 8)).save(tmp_path / "still.png")
    (tmp_path / "still.dat").write_bytes((tmp_path / "still.png").read_bytes())
    assert check_media([("image", tmp_path / "still.dat")]) == [("image", str(tmp_path / "still.dat"))]
    # the content decides over the name: a picture renamed clip.mp4 is still a picture
    (tmp_path / "renamed.mp4").write_bytes((tmp_path / "still.png").read_bytes())
    assert chat.main(["--video", str(tmp_path / "renamed.mp4"), "q"]) == 1
    assert capsys.readouterr().err.strip() == ("keye chat: error: renamed.mp4: given with --video, but it is an image "
                                               "(PNG); pass it with --image")


def test_media_go_to_the_model_in_the_order_given(tiny_ckpt, clip, tmp_path, monkeypatch, capsys):
    from PIL import Image

    pic = tmp_path / "red.png"
    Image.new("RGB", (40, 30), (220, 40, 40)).save(pic)
    seen = []
    original = ChatSession.messages

    def spy(self, question, video=None):
        msgs = original(self, question, video)
        seen.append([part["type"] for part in msgs[0]["content"]])
        return msgs

    monkeypatch.setattr(ChatSession, "messages", spy)
    common = ["--model", str(tiny_ckpt), "--max-new-tokens", "2", "--device", "cpu", "q"]
    assert chat.main(["--image", str(pic), "--video", str(clip), *common]) == 0
    assert chat.main(["--video", str(clip), "--image", str(pic), "--image", str(pic), *common]) == 0
    assert seen == [["image", "video", "text"], ["video", "image", "image", "text"]]
