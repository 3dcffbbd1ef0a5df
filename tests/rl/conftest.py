"""Fixtures for the RL tests: the tiny offline processor and tiny models (preview and 1.5)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def rl_processor(tmp_path_factory):
    """The tiny offline preview processor (token ids match ``tiny_config("preview")``)."""
    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    return KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path_factory.mktemp("rl_proc")))


@pytest.fixture(scope="session")
def rl_video(tmp_path_factory):
    """A 12-frame, 10 fps test video (64 x 84)."""
    from keye.testing.processor import make_test_video

    return make_test_video(tmp_path_factory.mktemp("rl_vid") / "clip.mp4", 12, fps=10.0, size=(56, 84))


@pytest.fixture()
def tiny_model():
    from keye.testing.model import make_tiny_model

    return make_tiny_model("preview", seed=0)


