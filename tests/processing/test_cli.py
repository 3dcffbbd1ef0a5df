"""``keye process`` and ``keye chat`` (the demo area's) on tiny offline fixtures."""

from __future__ import annotations

import json
import shutil

import pytest

from keye.cli import main
from keye.testing.processor import make_test_video, make_tiny_processor_dir
from tests.paths import GOLDEN_PREVIEW as GOLDEN


def test_process_prints_counts_and_video_meta(tmp_path, capsys):
    proc_dir = make_tiny_processor_dir(tmp_path / "p")
    clip = make_test_video(tmp_path / "c.mp4", 20, fps=10, size=(64, 128))
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(GOLDEN / "images" / "img2_224x224.png")},
                {"type": "video", "video": str(clip.path), "fps": 2.0},
                {"type": "text", "text": "Describe."},
            ],
        },
        {"role": "assistant", "content": "A test."},
    ]
    f = tmp_path / "m.json"
    f.write_text(json.dumps(msgs))
    assert main(["process", str(f), "--processor", str(proc_dir), "--training", "--backend", "pyav"]) == 0
    out = json.loads(capsys.readouterr().out)
    row = out["rows"][0]
    assert row["image_tokens"] == 64  # 224x224 -> 16 x 16 patches -> 64 tokens
    # 2 s at 2 fps -> 4 frames of 224x448 (min-pixel upscale) -> 16 x 32 patches -> 128 tokens each
    assert row["video_tokens"] == 4 * 128 and out["videos"][0]["indices"] == [0, 6, 13, 19]
    assert out["videos"][0]["backend"] == "pyav"
    from transformers import AutoTokenizer

    answer = AutoTokenizer.from_pretrained(str(proc_dir))("A test.", add_special_tokens=False)["input_ids"]
    assert row["trained_tokens"] == len(answer) + 1  # the answer and its closing <|im_end|>


def test_process_bad_file_exit_code(tmp_path, capsys):
    assert (
        main(
            ["process", str(tmp_path / "missing.json"), "--processor", str(make_tiny_processor_dir(tmp_path))]
        )
        == 1
    )
    assert "message file not found" in capsys.readouterr().err


@pytest.mark.slow
def test_chat_with_tiny_checkpoint(tmp_path, capsys):
    ckpt = make_tiny_processor_dir(tmp_path / "ckpt")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(GOLDEN / name, ckpt / name)
    img = str(GOLDEN / "images" / "img1_100x60.png")
    assert (
        main(["chat", "What is it?", "--model", str(ckpt), "--image", img, "--max-new-tokens", "5", "--json"])
        == 0
    )
    parsed = json.loads(capsys.readouterr().out)
    assert set(parsed) >= {"analysis", "think", "answer", "boxed", "mode"}
