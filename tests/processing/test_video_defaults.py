"""Checkpoint-level video defaults (preprocessor_config.json "video_defaults") and the frame-size floor."""

from __future__ import annotations

import json

import pytest

from keye import KeyeProcessor
from keye.errors import KeyeInputError
from keye.processing.slowfast import max_frames_for_budget, slowfast_sizes
from keye.testing.processor import make_test_video, make_tiny_processor_dir


def test_floor_pixels_lowers_the_minimum_frame_size():
    official = slowfast_sizes(1, 3, 112, 112)
    assert official.slow_tokens >= 48 and official.fast_tokens >= 48  # 37,632-pixel floor
    small = slowfast_sizes(1, 3, 112, 112, floor_pixels=3136, max_pixels=112 * 112)
    assert small.slow_hw == (112, 112) and small.slow_tokens == 16
    assert small.fast_tokens == 4  # max(0.3 * 16 tokens, 4-token floor)
    assert max_frames_for_budget(floor_pixels=3136) == 65536 * 784 // 3136
    from keye.processing.video import VideoOptions

    with pytest.raises(KeyeInputError, match="floor_pixels"):
        VideoOptions.from_item({"floor_pixels": 0})


def test_processor_applies_checkpoint_video_defaults(tmp_path):
    d = make_tiny_processor_dir(tmp_path / "proc", variant="1.5")
    pre = json.loads((d / "preprocessor_config.json").read_text())
    pre["video_defaults"] = {"floor_pixels": 3136, "max_pixels": 12544, "max_frames": 6}
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    video = make_test_video(tmp_path / "v.mp4", n_frames=40, fps=10, size=(112, 112), pattern="scenes")
    proc = KeyeProcessor.from_pretrained(d)
    msgs = [{"role": "user", "content": [{"type": "video", "video": str(video.path)}, {"type": "text", "text": "hi"}]}]
    meta = proc(msgs).video_meta[0]
    assert len(meta.frame_types) == 6
    assert max(meta.frame_tokens) <= 16 and min(meta.frame_tokens) >= 4
    # An item's own options win over the checkpoint defaults.
    msgs[0]["content"][0]["max_frames"] = 3
    assert len(proc(msgs).video_meta[0].frame_types) == 3
    again = KeyeProcessor.from_pretrained(proc.save_pretrained(tmp_path / "saved"))
    assert again.image_processor.config.video_defaults == pre["video_defaults"]
