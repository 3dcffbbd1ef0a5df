"""Video decoding and sampling on PyAV-written clips whose frame index is encoded in the pixels."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keye.errors import KeyeInputError
from keye.processing import video as V
from keye.processing.video import (
    VideoOptions,
    choose_backends,
    decode_frames,
    fetch_video,
    plan_video,
    probe_video,
    sample_frames,
)
from keye.testing.processor import make_test_video, read_frame_index
from tests.system import need_system

BACKENDS = ["pyav", "decord", "torchcodec"]


def _need(backend: str) -> None:
    # decord2 ships its own FFmpeg; torchcodec loads the system's FFmpeg shared libraries.
    need_system("ffmpeg", backend in V.available_backends(), f"video backend {backend}")


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return {
        "cfr": make_test_video(d / "cfr.mp4", 40, fps=10, size=(64, 128)),
        "vfr": make_test_video(d / "vfr.mp4", 40, fps=10, size=(64, 128), vfr=True),
        "bframes": make_test_video(d / "bf.mp4", 40, fps=10, size=(64, 128), bframes=3),
    }


def _indices_in_pixels(frames: np.ndarray) -> list[int]:
    return [read_frame_index(f) for f in frames]


def test_probe_reads_true_timestamps(clips):
    for clip in clips.values():
        probe = probe_video(str(clip.path))
        assert probe.n_frames == 40
        np.testing.assert_allclose(probe.timestamps, clip.timestamps, atol=1e-6)
    assert V.is_constant_rate(probe_video(str(clips["cfr"].path)).timestamps)
    assert not V.is_constant_rate(probe_video(str(clips["vfr"].path)).timestamps)


def test_cfr_sampling_rules_by_hand(clips):
    probe = probe_video(str(clips["cfr"].path))
    # preview: 40 frames / 10 fps * 2 = 8 (even, in [4, 40]); linspace(0, 39, 8) rounded
    plan = sample_frames(probe.timestamps, probe.fps, VideoOptions(fps=2.0), "preview")
    assert plan.indices == [0, 6, 11, 17, 22, 28, 33, 39]
    assert plan.sample_fps == pytest.approx(2.0)
    # 1.5: int(4 s * 2) = 8 frames, same linspace
    assert sample_frames(probe.timestamps, probe.fps, VideoOptions(fps=2.0), "1.5").indices == plan.indices
    # preview nframes=5 rounds (banker's) to 4; 1.5 takes it as is
    assert len(sample_frames(probe.timestamps, probe.fps, VideoOptions(nframes=5), "preview").indices) == 4
    assert len(sample_frames(probe.timestamps, probe.fps, VideoOptions(nframes=5), "1.5").indices) == 5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["cfr", "vfr", "bframes"])
@pytest.mark.parametrize("variant", ["preview", "1.5"])
def test_sampled_frames_and_timestamps(clips, backend, kind, variant):
    _need(backend)
    clip = clips[kind]
    probe = probe_video(str(clip.path))
    plan = sample_frames(probe.timestamps, probe.fps, VideoOptions(fps=2.0), variant)
    frames, times, used = decode_frames(probe, plan.indices, backend)
    assert used == backend
    assert _indices_in_pixels(frames) == plan.indices
    np.testing.assert_allclose(times, [clip.timestamps[i] for i in plan.indices], atol=1e-4)
    if kind == "vfr":
        # each sampled frame is the one shown nearest to its evenly spaced target time
        ts = np.asarray(clip.timestamps)
        targets = np.linspace(ts[0], ts[-1], len(plan.indices))
        for i, t in zip(plan.indices, targets):
            assert abs(ts[i] - t) == pytest.approx(np.abs(ts - t).min())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["cfr", "vfr"])
@pytest.mark.parametrize("variant", ["preview", "1.5"])
def test_time_range(clips, backend, kind, variant):
    _need(backend)
    clip = clips[kind]
    probe = probe_video(str(clip.path))
    opts = VideoOptions(fps=2.0, video_start=1.0, video_end=3.0)
    plan = sample_frames(probe.timestamps, probe.fps, opts, variant)
    frames, times, _ = decode_frames(probe, plan.indices, backend)
    assert _indices_in_pixels(frames) == plan.indices
    assert all(1.0 - 1e-6 <= t <= 3.0 + 1e-6 for t in times)
    if kind == "cfr":
        # frames 10..30 (21 frames): preview 21/10*2 = 4.2 -> floor to even -> 4; 1.5 int(2.1 s * 2) = 4;
        # linspace(10, 30, 4) rounded
        assert plan.indices == [10, 17, 23, 30]


def test_backends_agree(clips):
    avail = V.available_backends()
    for clip in clips.values():
        probe = probe_video(str(clip.path))
        idx = [0, 3, 7, 19, 20, 38]
        results = {b: decode_frames(probe, idx, b) for b in avail}
        ref_frames, ref_times, _ = results["pyav"]
        for frames, times, _ in results.values():
            assert _indices_in_pixels(frames) == idx
            np.testing.assert_allclose(times, ref_times, atol=1e-4)
            assert np.abs(frames.astype(int) - ref_frames.astype(int)).mean() < 2.0


def test_seek_decode_matches_sequential_decode(clips):
    import av

    probe = probe_video(str(clips["cfr"].path))
    with av.open(str(clips["cfr"].path)) as c:
        every = [f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])]
    idx = [39, 2, 13, 14, 26]  # unsorted, adjacent, across GOPs
    frames, _, _ = decode_frames(probe, idx, "pyav")
    for k, i in enumerate(idx):
        np.testing.assert_array_equal(frames[k], every[i])


def test_fallback_when_a_backend_fails(clips, monkeypatch):
    def broken(probe, indices):
        raise RuntimeError("simulated decoder failure")

    monkeypatch.setitem(V._DECODERS, "decord", broken)
    monkeypatch.setattr(V, "available_backends", lambda: ["decord", "pyav"])
    probe = probe_video(str(clips["cfr"].path))
    frames, _, used = decode_frames(probe, [0, 10], "decord")
    assert used == "pyav" and _indices_in_pixels(frames) == [0, 10]


def test_backend_choice_env(monkeypatch):
    monkeypatch.setenv(V.ENV_BACKEND, "pyav")
    assert choose_backends()[0] == "pyav"
    assert choose_backends("PyAV")[0] == "pyav"
    monkeypatch.setenv(V.ENV_BACKEND, "nonsense")
    with pytest.raises(KeyeInputError, match="unknown video backend"):
        choose_backends()


def test_plan_video_pure_preview_1080p():
    # 60 s at 30 fps: 1800 frames * 2 / 30 = 120 frames; max_pixels = min(602112, 90316800/120*2) = 602112
    # -> smart_resize(1080, 1920) = 560 x 1008 (beta = sqrt(2073600/602112)) -> grid 40 x 72 -> 720 tokens
    plan = plan_video(1800, 30.0, 1080, 1920, "preview")
    assert plan.n_frames == 120
    assert plan.indices == _ref_linspace(0, 1799, 120)
    assert plan.resized_hw == (560, 1008) and plan.frame_grid == [1, 40, 72]
    assert plan.total_tokens == 120 * 720
    assert plan_video(None, 30.0, 1080, 1920, "preview", duration=60.0).indices == plan.indices
    # max_frames caps the count (floor to even)
    assert plan_video(1800, 30.0, 1080, 1920, "preview", {"max_frames": 17}).n_frames == 16


def test_plan_video_pure_v15():
    plan = plan_video(1800, 30.0, 1080, 1920, "1.5")
    assert plan.n_frames == 120 and plan.resized_hw is None
    assert (
        plan_video(1800, 30.0, 1080, 1920, "1.5", {"fps": 60}).n_frames == 1365
    )  # fps capped to 30, budget cap
    assert plan_video(1800, 30.0, 1080, 1920, "1.5", {"max_frames": 50}).n_frames == 50


def test_fetch_video_preview_resize_and_meta(clips):
    v = fetch_video(str(clips["cfr"].path), VideoOptions(fps=2.0), "preview", backend="pyav")
    # 64x128 is below VIDEO_MIN_PIXELS (100352): beta = sqrt(100352/8192) = 3.5 -> ceil(8)*28, ceil(16)*28
    assert v.frames.shape == (8, 224, 448, 3)
    assert v.indices == [0, 6, 11, 17, 22, 28, 33, 39]
    assert v.sample_fps == pytest.approx(2.0) and v.video_fps == pytest.approx(10.0)


def test_fetch_video_frame_list_and_array():
    frames = [np.full((56, 84, 3), 10 * i, np.uint8) for i in range(5)]
    v = fetch_video(frames, VideoOptions(fps=1.0), "preview")
    assert v.indices == [0, 1, 2, 3, 4, 4]  # padded to even by repeating the last frame
    assert v.timestamps == [0.0, 1.0, 2.0, 3.0, 4.0, 4.0]
    arr = np.stack(frames)
    v = fetch_video(arr, VideoOptions(), "1.5")
    assert v.indices == [0, 1, 2, 3, 4] and v.timestamps is None  # 1.5: timestamps only with a given fps
    assert v.frames.shape == (5, 56, 84, 3)


def _ref_linspace(start: int, end: int, n: int) -> list[int]:
    # the reference samplers' torch.linspace (float32) rounded half to even
    import torch

    return torch.linspace(start, end, n).round().long().tolist()


def _spec_smart_nframes(total: int, video_fps: float, fps: float) -> int:
    # architecture.md §9.3, written out directly
    import math

    min_f = math.ceil(4 / 2) * 2
    max_f = math.floor(min(768, total) / 2) * 2
    n = total / video_fps * fps
    n = min(min(max(n, min_f), max_f), total)
    return math.floor(n / 2) * 2


@settings(max_examples=200, deadline=None)
@given(
    total=st.integers(4, 5000),
    video_fps=st.sampled_from([23.976, 24.0, 25.0, 29.97, 30.0, 50.0, 59.94, 60.0, 7.5]),
    fps=st.sampled_from([0.5, 1.0, 2.0, 3.0]),
)
def test_preview_count_and_indices_follow_the_spec(total, video_fps, fps):
    ts = np.arange(total) / video_fps
    plan = sample_frames(ts, video_fps, VideoOptions(fps=fps), "preview")
    n = _spec_smart_nframes(total, video_fps, fps)
    assert plan.indices == _ref_linspace(0, total - 1, n)
    assert plan.sample_fps == n / total * video_fps
    n15 = min(int(total / video_fps * min(fps, video_fps)), 1365)  # §10.2
    plan15 = sample_frames(ts, video_fps, VideoOptions(fps=fps), "1.5")
    # a clip shorter than one sampling step still gives its first frame (the reference fails there)
    assert plan15.indices == (_ref_linspace(0, total - 1, n15) if n15 else [0])


def test_preview_frame_resize_equals_torchvision():
    # keye-vl-utils 1.0.0 resizes video frames with torchvision BICUBIC + antialias on uint8 tensors
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    x = np.random.default_rng(0).integers(0, 256, (3, 64, 128, 3)).astype(np.uint8)
    for size in [(224, 448), (28, 56), (100, 60)]:
        ref = TF.resize(
            torch.from_numpy(x).permute(0, 3, 1, 2), list(size), InterpolationMode.BICUBIC, antialias=True
        )
        np.testing.assert_array_equal(V.resize_bicubic_u8(x, size), ref.permute(0, 2, 3, 1).numpy())


def test_fallback_logs_one_warning_naming_clip_backend_and_reason(clips, monkeypatch, caplog):
    decord = pytest.importorskip("decord")
    _need("decord")

    def failing_get_batch(self, indices):
        raise RuntimeError("simulated get_batch failure")

    monkeypatch.setattr(decord.VideoReader, "get_batch", failing_get_batch)
    path = str(clips["cfr"].path)
    probe = probe_video(path)
    with caplog.at_level(logging.WARNING, logger="keye.processing.video"):
        frames, _, used = decode_frames(probe, [0, 10], "decord")
    assert used == "pyav" and _indices_in_pixels(frames) == [0, 10]
    records = [r for r in caplog.records if r.name == "keye.processing.video"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert path in message and "decord" in message and "simulated get_batch failure" in message
    # a backend that works logs nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="keye.processing.video"):
        decode_frames(probe, [0, 10], "pyav")
    assert not [r for r in caplog.records if r.name == "keye.processing.video"]


def _one_video_message(path: str, **options) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "video", "video": path, **options},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]


@pytest.fixture(scope="module")
def short_clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("short")
    return {n: make_test_video(d / f"f{n}.mp4", n, fps=10, size=(56, 84)) for n in (1, 2, 3)}


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    from keye import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    d = tmp_path_factory.mktemp("procs")
    return {
        v: KeyeProcessor.from_pretrained(make_tiny_processor_dir(d / v, variant=v))
        for v in ("preview", "1.5")
    }


@pytest.mark.parametrize("n_frames", [1, 2, 3])  # 0.1 / 0.2 / 0.3 s: all shorter than one 2-fps step
def test_short_clip_through_the_v15_processor(short_clips, processors, n_frames):
    proc = processors["1.5"]
    b = proc(_one_video_message(str(short_clips[n_frames].path), fps=2.0))
    meta = b.video_meta[0]
    # int(0.1 * n_frames s * 2 fps) = 0 samples: the first frame stands for the clip
    assert meta.indices == [0] and meta.frame_types == ["slow"] and meta.timestamps == [0.0]
    # 56x84 is below the 37,632-pixel floor: smart_resize scales it up to 168 x 252 -> grid 12 x 18
    assert meta.frame_grids == [[1, 12, 18]] and b.video_grid_thw.tolist() == [[1, 12, 18]]
    assert b.pixel_values_videos.shape == (12 * 18, 3, 14, 14)
    ids = b.input_ids[0].tolist()
    tid = proc.token_ids
    run = [tid["<|frame|>"], *proc.tokenizer("0.0", add_special_tokens=False)["input_ids"]]
    run += [tid["<|video_pad|>"]] * (12 * 18 // 4)
    start = ids.index(tid["<|vision_start|>"])
    assert ids[start + 1 : start + 1 + len(run) + 1] == run + [tid["<|vision_end|>"]]


def test_one_frame_clip_through_the_preview_processor(short_clips, processors):
    proc = processors["preview"]
    b = proc(_one_video_message(str(short_clips[1].path)))
    meta = b.video_meta[0]
    # one frame fills the 2-frame temporal patch by repeating itself
    assert meta.indices == [0, 0] and meta.timestamps == [0.0, 0.0]
    t, h, w = b.video_grid_thw.tolist()[0]
    assert t == 2 and b.pixel_values_videos.shape[0] == t * h * w
    assert int((b.input_ids == proc.video_token_id).sum()) == t * h * w // 4 == meta.tokens
    half = b.pixel_values_videos.shape[0] // 2
    assert torch.equal(b.pixel_values_videos[:half], b.pixel_values_videos[half:])


def test_single_frame_time_range_is_a_video(clips):
    # [1.0, 1.05] s holds only frame 10 of the 10-fps clip
    v = fetch_video(
        str(clips["cfr"].path), VideoOptions(video_start=1.0, video_end=1.05), "1.5", backend="pyav"
    )
    assert v.indices == [10] and _indices_in_pixels(v.frames) == [10]
    p = fetch_video(
        str(clips["cfr"].path), VideoOptions(video_start=1.0, video_end=1.05), "preview", backend="pyav"
    )
    assert p.indices == [10, 10]


def test_video_total_pixels_is_read_and_conflicts_are_named():
    assert VideoOptions.from_item({"video_total_pixels": 1000}).total_pixels == 1000
    assert VideoOptions.from_item({"video_total_pixels": 1000, "total_pixels": 1000}).total_pixels == 1000
    with pytest.raises(KeyeInputError, match="video_total_pixels") as err:
        VideoOptions.from_item({"video_total_pixels": 1000, "total_pixels": 2000}, item="video 2")
    assert "video 2" in str(err.value)


def test_official_timestamps_are_float32_and_format_like_the_reference():
    # keye-vl-utils builds torch.FloatTensor([(1 / fps) * i ...]); the 1.5 prompt formats those float32 values
    fps, idx = 20.0, [0, 1, 3, 7, 13, 399]
    ref = torch.FloatTensor([(1 / fps) * i for i in idx])
    got = V.official_timestamps(idx, fps)
    assert got == ref.tolist()
    assert [format(t, ".1f") for t in got] == [format(ref[j], ".1f") for j in range(len(idx))]
    # frame 3 at 20 fps: 0.15 s is 0.1499... in float64 ("0.1") but 0.15000001 in float32 ("0.2")
    assert format(got[2], ".1f") == "0.2" and format(3 / 20, ".1f") == "0.1"
