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


def test_override_preprocessor_raises_the_frame_budget_and_is_saved(tmp_path):
    d = make_tiny_processor_dir(tmp_path / "proc", variant="1.5")
    pre = json.loads((d / "preprocessor_config.json").read_text())
    pre["video_defaults"] = {"floor_pixels": 3136, "max_pixels": 12544, "max_frames": 6}
    pre["max_pixels"] = 12544
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    video = make_test_video(tmp_path / "v.mp4", n_frames=40, fps=10, size=(224, 112), pattern="scenes")
    msgs = [{"role": "user", "content": [{"type": "video", "video": str(video.path)}, {"type": "text", "text": "hi"}]}]
    proc = KeyeProcessor.from_pretrained(d)
    before = max(proc(msgs).video_meta[0].frame_tokens)
    proc.override_preprocessor({"max_pixels": 25088, "video_defaults": {"max_pixels": 25088}})
    after = proc(msgs).video_meta[0]
    # 224 x 112 fits the new budget unscaled: 16 x 8 patches, 32 merged tokens per key frame.
    assert before < 32 and max(after.frame_tokens) == 32
    assert len(after.frame_types) == 6  # the other video defaults are kept
    saved = json.loads((proc.save_pretrained(tmp_path / "saved") / "preprocessor_config.json").read_text())
    assert saved["max_pixels"] == 25088
    assert saved["video_defaults"] == {"floor_pixels": 3136, "max_pixels": 25088, "max_frames": 6}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_pixel": 25088}, "unknown preprocessor field.*max_pixel"),
        ({"min_pixels": 10**12}, "invalid image processor config"),
        ({"video_defaults": {"max_pixels": -1}}, "max_pixels must be a positive number"),
        ({"video_defaults": 25088}, "video_defaults must be a mapping"),
    ],
)
def test_override_preprocessor_rejects_bad_fields_and_keeps_the_old_config(tmp_path, overrides, message):
    from keye.errors import KeyeConfigError

    proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path / "proc", variant="1.5"))
    old = proc.image_processor.config
    with pytest.raises(KeyeConfigError, match=f"model.preprocessor: .*{message}"):
        proc.override_preprocessor(overrides, where="model.preprocessor")
    assert proc.image_processor.config is old
