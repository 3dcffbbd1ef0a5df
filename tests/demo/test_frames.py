"""The gallery shows exactly what the processor fed the model: frames rebuilt from the patch rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from keye.demo.frames import seen_frames, token_summary, unpatchify
from keye.demo.session import ChatSession, VideoSettings
from keye.processing.processor import KeyeProcessor


@pytest.fixture(scope="module")
def proc(tiny_ckpt):
    return KeyeProcessor.from_pretrained(tiny_ckpt)


def test_unpatchify_inverts_the_image_processor(proc):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(2, 56, 84, 3), dtype=np.uint8)
    pv, grid = proc.image_processor.preprocess_resized(frames)
    assert grid == [2, 4, 6]
    cfg = proc.image_processor.config
    for t in range(2):
        rows = pv[t * 24 : (t + 1) * 24]
        np.testing.assert_array_equal(unpatchify(rows, (4, 6), cfg.image_mean, cfg.image_std), frames[t])
    with pytest.raises(ValueError, match="do not tile"):
        unpatchify(pv[:23], (4, 6), cfg.image_mean, cfg.image_std)


def _decode(path, index):
    import av

    with av.open(str(path)) as c:
        for i, f in enumerate(c.decode(video=0)):
            if i == index:
                return f.to_ndarray(format="rgb24")
    raise AssertionError(index)


def test_seen_frames_match_processor_output(proc, clip, tmp_path):
    img_path = tmp_path / "red.png"
    Image.new("RGB", (60, 40), (220, 40, 40)).save(img_path)
    session = ChatSession(media=[("video", str(clip)), ("image", str(img_path))])
    batch = proc(session.messages("What happens?", VideoSettings(fps=2.0, max_frames=32)))
    frames = seen_frames(batch, proc)
    meta = batch.video_meta[0]
    # 3 s at 2 fps: 6 frames at linspace(0, 29, 6).round() = 0, 6, 12, 17, 23, 29 (docs/architecture.md §10.2).
    assert meta.indices == [0, 6, 12, 17, 23, 29]
    video = [f for f in frames if f.source == "video 0"]
    assert [f.index for f in video] == meta.indices
    assert [f.timestamp for f in video] == pytest.approx([i / 10 for i in meta.indices])
    # "scenes" clip: one texture up to frame 14, another from 15; only the index strip changes in between,
    # so the first frame of each scene is slow and the rest are fast.
    assert [f.kind for f in video] == ["slow", "fast", "fast", "slow", "fast", "fast"]
    assert [f.tokens for f in video] == meta.frame_tokens
    n_video_pad = int((batch["input_ids"] == proc.video_token_id).sum())
    assert sum(f.tokens for f in video) == n_video_pad
    for f, grid in zip(video, meta.frame_grids):
        assert f.size == (grid[1] * 14, grid[2] * 14)
        assert f.image.size == (grid[2] * 14, grid[1] * 14)
    # Pixel content: the rebuilt slow frame looks like the decoded source frame (resizing changes
    # details, not the average colour).
    for f in video:
        src = _decode(clip, f.index).astype(np.float64)
        rebuilt = np.asarray(f.image, dtype=np.float64)
        assert np.abs(src.mean(axis=(0, 1)) - rebuilt.mean(axis=(0, 1))).max() < 4.0
    (image,) = [f for f in frames if f.kind == "image"]
    assert (
        image.tokens == batch.image_meta[0].tokens == int((batch["input_ids"] == proc.image_token_id).sum())
    )
    assert np.abs(np.asarray(image.image, dtype=float).mean(axis=(0, 1)) - [220, 40, 40]).max() < 2
    assert video[0].caption() == f"0.0 s · slow · {video[0].tokens} tok"
    assert image.caption() == f"image 0 · image · {image.tokens} tok"

    s = token_summary(batch, frames)
    assert s["slow_frames"] == 2 and s["fast_frames"] == 4 and s["images"] == 1
    assert s["visual_tokens"] == n_video_pad + image.tokens
    assert s["prompt_tokens"] == batch["input_ids"].shape[1]
    assert s["slow_tokens"] + s["fast_tokens"] == n_video_pad


def test_frame_files_write_each_picture_once_and_never_rewrite_it(proc, clip, tmp_path):
    # Gradio rewrites a returned PIL image at a content-fixed cache path on every return, which truncated a
    # picture a client was downloading when the demo returned the gallery twice; paths are copied once.
    from keye.demo.app import frame_files

    batch = proc(ChatSession(media=[("video", str(clip))]).messages("What happens?", VideoSettings()))
    frames = seen_frames(batch, proc)
    first = frame_files(frames, tmp_path / "frames")
    assert [c for _, c in first] == [f.caption() for f in frames]
    for (path, _), f in zip(first, frames):
        np.testing.assert_array_equal(np.asarray(Image.open(path).convert("RGB")), np.asarray(f.image))
    stats = {p: (Path(p).stat().st_ino, Path(p).stat().st_mtime_ns) for p, _ in first}
    again = frame_files(frames, tmp_path / "frames")
    assert again == first
    assert {p: (Path(p).stat().st_ino, Path(p).stat().st_mtime_ns) for p, _ in again} == stats
    # One file per distinct picture, nothing left half-written beside them.
    files = sorted((tmp_path / "frames").iterdir())
    assert len(files) == len({p for p, _ in first}) and not any(f.name.startswith(".") for f in files)
