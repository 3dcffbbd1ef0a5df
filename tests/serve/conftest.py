"""A live ``keye serve`` on keye-tiny (uvicorn on a free loopback port, in this process) for the tests."""

from __future__ import annotations

import socket

import pytest

from keye.serve.app import BackgroundServer, KeyeServer, ServerConfig
from keye.serve.engine import EngineConfig
from keye.serve.media import MediaPolicy
from keye.serve.protocol import ServerLimits


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny():
    import keye

    return keye.load_tiny()


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory):
    """A folder the server may read local files from, with a clip and an image."""
    from PIL import Image

    from keye.testing.processor import make_test_video

    d = tmp_path_factory.mktemp("media")
    make_test_video(d / "clip.mp4", 20, fps=10, size=(64, 96))
    Image.new("RGB", (80, 60), (220, 40, 40)).save(d / "red.png")
    (d / "broken.mp4").write_bytes(b"this is not a video")
    return d


@pytest.fixture(scope="module")
def live(tiny, media_dir):
    model, processor = tiny
    config = ServerConfig(
        model_name="keye-tiny",
        engine=EngineConfig(max_batch_size=8, batch_window_ms=20, max_queue=64),
        limits=ServerLimits(max_tokens=64, default_max_tokens=16, max_frames=16),
        media=MediaPolicy(max_bytes=2_000_000, timeout=5, allowed_dirs=[media_dir]),
        max_body_bytes=4_000_000,
    )
    with BackgroundServer(KeyeServer(model, processor, config)) as srv:
        yield srv


@pytest.fixture()
def client(live):
    from openai import OpenAI

    return OpenAI(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
