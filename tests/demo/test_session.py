"""Media checks, conversation building, partial-reply splitting and sampling settings."""

from __future__ import annotations

import pytest

from keye.demo.session import (
    ChatSession,
    SamplingSettings,
    VideoSettings,
    check_media,
    media_kind,
    split_partial,
)
from keye.errors import KeyeInputError


def test_media_kind_by_extension():
    assert media_kind("a/b/Clip.MP4") == "video"
    assert media_kind("x.webm") == "video"
    assert media_kind("photo.JPEG") == "image"
    with pytest.raises(KeyeInputError, match=r"notes\.txt: unsupported file type '\.txt'"):
        media_kind("/tmp/up/notes.txt")
    with pytest.raises(KeyeInputError, match="no extension"):
        media_kind("README")


def test_check_media_accepts_good_files(clip, tmp_path):
    from PIL import Image

    img = tmp_path / "frame.png"
    Image.new("RGB", (32, 32), (200, 10, 10)).save(img)
    assert check_media([clip, img]) == [("video", str(clip)), ("image", str(img))]


def test_check_media_rejects_bad_files(corrupt_clip, tmp_path, clip):
    with pytest.raises(KeyeInputError, match=r"^broken\.mp4: unreadable, truncated or corrupt video"):
        check_media([corrupt_clip])
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(KeyeInputError, match=r"empty\.mp4: file is empty"):
        check_media([empty])
    with pytest.raises(KeyeInputError, match="file not found"):
        check_media([tmp_path / "missing.mov"])
    # The fixture clip lasts 30 frames / 10 fps = 3.0 s.
    with pytest.raises(KeyeInputError, match=r"clip\.mp4: video is too long \(3\.0 s\).*at most 2 s"):
        check_media([clip], max_video_seconds=2.0)
    assert check_media([clip], max_video_seconds=3.5)[0][0] == "video"


def test_check_media_rejects_audio_only_container(tmp_path):
    import av
    import numpy as np

    path = tmp_path / "voice.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    with pytest.raises(KeyeInputError, match=r"voice\.mp4: file has no video stream"):
        check_media([path])


def test_video_settings_item():
    item = VideoSettings(
        fps=1.5, max_frames=12, token_budget=1000, slow_fast=False, min_frame_similarity=0.8
    ).item("v.mp4")
    assert item == {
        "type": "video",
        "video": "v.mp4",
        "fps": 1.5,
        "max_frames": 12,
        "total_pixels": 1000 * 28 * 28,
        "slow_fast": False,
        "min_frame_similarity": 0.8,
    }
    bare = VideoSettings(
        fps=None, max_frames=None, token_budget=None, slow_fast=None, min_frame_similarity=None
    )
    assert bare.item("v.mp4") == {"type": "video", "video": "v.mp4"}


def test_video_settings_follow_the_checkpoint_defaults(tiny_ckpt):
    from keye.processing.image import ImageProcessorConfig
    from keye.processing.processor import KeyeProcessor

    proc = KeyeProcessor.from_pretrained(tiny_ckpt)
    assert VideoSettings.for_checkpoint(proc) == VideoSettings()  # no video_defaults: the demo's own
    proc.image_processor.config = ImageProcessorConfig(
        variant="1.5",
        video_defaults={"fps": 4.0, "max_frames": 16, "total_pixels": 300 * 784, "max_pixels": 25088},
    )
    got = VideoSettings.for_checkpoint(proc)
    assert (got.fps, got.max_frames, got.token_budget, got.slow_fast) == (4.0, 16, 300, True)


def test_chat_session_messages_multi_turn():
    s = ChatSession(media=[("video", "v.mp4"), ("image", "i.png")])
    first = s.messages("What moves?")
    assert first == [
        {
            "role": "user",
            "content": [
                VideoSettings().item("v.mp4"),
                {"type": "image", "image": "i.png"},
                {"type": "text", "text": "What moves?"},
            ],
        }
    ]
    s.turns.append(("What moves?", "A red circle."))
    msgs = s.messages("Which way?")
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    assert msgs[0]["content"][0]["type"] == "video"  # media only in the first user turn
    assert msgs[1]["content"] == "A red circle."
    assert msgs[2]["content"] == [{"type": "text", "text": "Which way?"}]
    with pytest.raises(KeyeInputError, match="question is empty"):
        s.messages("   ")


@pytest.mark.parametrize(
    "text, thinking, done, answer",
    [
        ("", None, True, ""),
        ("B", None, True, "B"),
        ("<think>the square goes", "the square goes", False, ""),
        ("<think>it moves right</think>\n\nB", "it moves right", True, "B"),
        ("<think>x</think><answer>B</answer>", "x", True, "B"),
        ("<analysis>easy</analysis>B", "easy", True, "B"),
        ("<analysis>hard</analysis><think>look", "hard\n\nlook", False, ""),
    ],
)
def test_split_partial(text, thinking, done, answer):
    view = split_partial(text)
    assert (view.thinking, view.thinking_done, view.answer) == (thinking, done, answer)


def test_sampling_settings():
    assert SamplingSettings(max_new_tokens=7, greedy=True, temperature=0.0).kwargs() == {
        "max_new_tokens": 7,
        "do_sample": False,
        "repetition_penalty": 1.0,
    }
    kw = SamplingSettings(greedy=False, temperature=0.5, top_p=0.8, top_k=5).kwargs()
    assert kw["do_sample"] and kw["temperature"] == 0.5 and kw["top_p"] == 0.8 and kw["top_k"] == 5
    with pytest.raises(KeyeInputError, match="temperature"):
        SamplingSettings(greedy=False, temperature=0).kwargs()
    with pytest.raises(KeyeInputError, match="max new tokens"):
        SamplingSettings(max_new_tokens=0).kwargs()
