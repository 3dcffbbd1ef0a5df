"""Fixtures for the demo tests: a random tiny Keye-VL-1.5 checkpoint (model + processor files) and clips."""

from __future__ import annotations

from pathlib import Path

import pytest

from keye.testing.model import save_tiny_checkpoint
from keye.testing.processor import make_test_video, make_tiny_processor_dir


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_ckpt")
    save_tiny_checkpoint(d, "1.5")
    make_tiny_processor_dir(d, variant="1.5")
    return d


@pytest.fixture(scope="session")
def clip(tmp_path_factory) -> Path:
    """A 3 s, 10 fps clip of 64x128 frames with a scene cut at frame 15 (slow frames on both sides)."""
    path = tmp_path_factory.mktemp("clips") / "clip.mp4"
    make_test_video(path, 30, fps=10.0, size=(64, 128), pattern="scenes", scene_cuts=(15,))
    return path


@pytest.fixture(scope="session")
def corrupt_clip(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "broken.mp4"
    path.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    return path
