"""Bad input: every case raises KeyeInputError naming the item / file and the reason; nothing crashes."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from keye.errors import KeyeInputError
from keye.processing.processor import KeyeProcessor
from keye.testing.processor import make_test_video, make_tiny_processor_dir


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    good = make_test_video(d / "good.mp4", 20, fps=10, size=(64, 128))
    data = good.path.read_bytes()
    (d / "truncated.mp4").write_bytes(data[: len(data) // 3])
    (d / "garbage.mp4").write_bytes(b"this is not a video at all" * 50)
    _empty_video(d / "empty.mp4")
    png = d / "ok.png"
    Image.new("RGB", (64, 64), (1, 2, 3)).save(png)
    (d / "broken.png").write_bytes(png.read_bytes()[:40])
    procs = {
        "preview": KeyeProcessor.from_pretrained(make_tiny_processor_dir(d / "pp")),
        "1.5": KeyeProcessor.from_pretrained(make_tiny_processor_dir(d / "p15", variant="1.5")),
    }
    return d, procs


def _empty_video(path: Path) -> None:
    """An MP4 written with a video stream but no frame (FFmpeg then drops the empty track)."""
    import av

    with av.open(str(path), mode="w") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
        c.start_encoding()


def _v(src, **kw):
    return [
        {"role": "user", "content": [{"type": "video", "video": src, **kw}, {"type": "text", "text": "?"}]}
    ]


def _i(src, **kw):
    return [
        {"role": "user", "content": [{"type": "image", "image": src, **kw}, {"type": "text", "text": "?"}]}
    ]


# (case id, variant, builder(dir) -> messages or a callable, fragment of the reason, fragment naming file/item)
CASES = [
    ("missing_image", "preview", lambda d: _i(str(d / "nope.png")), "not found", "nope.png"),
    ("missing_video", "preview", lambda d: _v(str(d / "nope.mp4")), "not found", "nope.mp4"),
    ("missing_file_uri", "preview", lambda d: _i(f"file://{d}/gone.png"), "not found", "gone.png"),
    ("truncated_video", "preview", lambda d: _v(str(d / "truncated.mp4")), "truncated", "truncated.mp4"),
    ("garbage_video", "1.5", lambda d: _v(str(d / "garbage.mp4")), "unreadable", "garbage.mp4"),
    (
        "container_without_frames",
        "preview",
        lambda d: _v(str(d / "empty.mp4")),
        "no video stream",
        "empty.mp4",
    ),
    ("zero_frames", "1.5", lambda d: _v(np.zeros((0, 28, 28, 3), np.uint8)), "zero frames", "video 0"),
    (
        "extreme_aspect_ratio",
        "preview",
        lambda d: _i(np.zeros((5, 1200, 3), np.uint8)),
        "aspect ratio",
        "image 0",
    ),
    ("image_too_small", "preview", lambda d: _i(np.zeros((2, 3, 3), np.uint8)), "too small", "image 0"),
    (
        "unknown_content_type",
        "preview",
        lambda d: [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}],
        "unknown content type",
        "0.0",
    ),
    ("unknown_role", "preview", lambda d: [{"role": "robot", "content": "hi"}], "unknown role", "item 0"),
    ("message_without_content", "preview", lambda d: [{"role": "user"}], "'role' and 'content'", "item 0"),
    ("bad_base64", "preview", lambda d: _i("data:image/png;base64,@@@notbase64@@@"), "base64", "image 0"),
    (
        "unsupported_scheme",
        "preview",
        lambda d: _i("ftp://example.com/x.png"),
        "unsupported URL scheme",
        "ftp://",
    ),
    ("unsupported_image_type", "preview", lambda d: _i(42), "unsupported image source", "image 0"),
    ("corrupt_png", "preview", lambda d: _i(str(d / "broken.png")), "cannot decode image", "broken.png"),
    (
        "bad_image_array_shape",
        "preview",
        lambda d: _i(np.zeros((2, 8, 8, 3), np.uint8)),
        "image array",
        "image 0",
    ),
    ("float_image_out_of_range", "preview", lambda d: _i(np.full((8, 8, 3), 2.0)), "[0, 1]", "image 0"),
    (
        "video_array_wrong_dtype",
        "preview",
        lambda d: _v(np.zeros((4, 28, 28, 3), np.float32)),
        "uint8",
        "video 0",
    ),
    (
        "frames_differ_in_size",
        "1.5",
        lambda d: _v([Image.new("RGB", (300, 200)), Image.new("RGB", (200, 300))]),
        "differ in size",
        "video 0",
    ),
    ("empty_frame_list", "preview", lambda d: _v([]), "empty", "video 0"),
    ("negative_fps", "preview", lambda d: _v(str(d / "good.mp4"), fps=-1), "positive number", "video 0"),
    (
        "range_end_before_start",
        "preview",
        lambda d: _v(str(d / "good.mp4"), video_start=1.5, video_end=0.5),
        "video_end",
        "video 0",
    ),
    (
        "range_outside_video",
        "1.5",
        lambda d: _v(str(d / "good.mp4"), video_start=50.0),
        "holds no frame",
        "good.mp4",
    ),
    (
        "half_resize",
        "preview",
        lambda d: _i(np.zeros((64, 64, 3), np.uint8), resized_height=56),
        "resized_height",
        "image 0",
    ),
    (
        "nframes_exceeds_video",
        "preview",
        lambda d: _v(str(d / "good.mp4"), nframes=40),
        "exceeds the 20 frames",
        "good.mp4",
    ),
    (
        "image_without_source",
        "preview",
        lambda d: [{"role": "user", "content": [{"type": "image"}]}],
        "no 'image'",
        "image 0",
    ),
    (
        "literal_placeholder_in_text",
        "preview",
        lambda d: [{"role": "user", "content": "look <|image_pad|>"}],
        "literal",
        None,
    ),
    ("unknown_mode", "preview", lambda d: ("mode", "deep"), "unknown thinking mode", None),
    ("unknown_backend", "preview", lambda d: ("backend", "gstreamer"), "unknown video backend", None),
    ("not_a_list", "preview", lambda d: "hello", "non-empty list", None),
]


def test_table_is_large_enough():
    assert len(CASES) >= 20


@pytest.mark.parametrize("case_id,variant,build,reason,where", CASES, ids=[c[0] for c in CASES])
def test_bad_input(env, case_id, variant, build, reason, where):
    d, procs = env
    proc = procs[variant]
    spec = build(d)
    with pytest.raises(KeyeInputError) as info:
        if isinstance(spec, tuple) and spec[0] == "mode":
            proc(_i(np.zeros((64, 64, 3), np.uint8)), mode=spec[1])
        elif isinstance(spec, tuple) and spec[0] == "backend":
            KeyeProcessor(proc.tokenizer, video_backend=spec[1])(_v(str(d / "good.mp4")))
        else:
            proc(spec)
    msg = str(info.value)
    assert reason in msg, msg
    if where is not None:
        assert where in msg, msg


def test_data_uri_and_good_inputs_still_work(env):
    d, procs = env
    uri = "data:image/png;base64," + base64.b64encode((d / "ok.png").read_bytes()).decode()
    b = procs["preview"](_i(uri))
    assert b.image_grid_thw.tolist() == [[1, 4, 4]]
    # 20 frames at 10 fps = 2 s at 2 fps -> 4 frames: linspace(0, 19, 4) rounded
    assert procs["1.5"](_v(str(d / "good.mp4"))).video_meta[0].indices == [0, 6, 13, 19]


def test_truncated_video_error_is_typed_for_every_backend(env):
    from keye.processing.video import available_backends, decode_frames, probe_video

    d, _ = env
    clip = make_test_video(d / "fs.mp4", 40, fps=10, size=(64, 128), faststart=True)
    data = clip.path.read_bytes()
    cut = d / "fs_truncated.mp4"
    cut.write_bytes(data[: len(data) // 2])
    probe = probe_video(str(cut))  # the index is at the front: the container still lists frames
    for backend in available_backends():
        with pytest.raises(KeyeInputError) as info:
            decode_frames(probe, [0, probe.n_frames - 1], backend)
        assert "fs_truncated.mp4" in str(info.value) and "cannot decode video" in str(info.value)
