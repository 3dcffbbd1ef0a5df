"""Media probing: header facts, corrupt/missing detection, and the (path, mtime, size)-keyed cache."""

from __future__ import annotations

import os
from pathlib import Path

import av
import numpy as np
from PIL import Image

from keye.data.manifest import MediaRef
from keye.data.probe import ProbeCache, probe_file, probe_media


def _write_clip(path: Path, n: int, fps: int, w: int = 64, h: int = 48) -> None:
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(n):
            arr = np.full((h, w, 3), i * 10 % 255, dtype=np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def test_video_and_image_facts(tmp_path: Path, cache: ProbeCache):
    _write_clip(tmp_path / "a.mp4", n=12, fps=4)
    info = probe_file("video", str(tmp_path / "a.mp4"), cache)
    assert info.ok and (info.width, info.height, info.num_frames) == (64, 48, 12)
    assert info.fps == 4.0 and abs(info.duration - 3.0) < 1e-6
    Image.new("RGB", (30, 20)).save(tmp_path / "i.png")
    im = probe_file("image", str(tmp_path / "i.png"), cache)
    assert im.ok and (im.width, im.height, im.num_frames) == (30, 20, 1)


def test_bad_media_reported_not_raised(tmp_path: Path, cache: ProbeCache):
    (tmp_path / "junk.mp4").write_bytes(b"\x00\x01garbage" * 100)
    _write_clip(tmp_path / "a.mp4", n=8, fps=4)
    data = (tmp_path / "a.mp4").read_bytes()
    (tmp_path / "trunc.mp4").write_bytes(data[: len(data) // 3])
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    assert "not found" in probe_file("video", str(tmp_path / "missing.mp4"), cache).error
    assert "cannot decode" in probe_file("video", str(tmp_path / "junk.mp4"), cache).error
    assert not probe_file("video", str(tmp_path / "trunc.mp4"), cache).ok
    assert "cannot read image" in probe_file("image", str(tmp_path / "bad.png"), cache).error
    assert "remote" in probe_media(MediaRef("image", "https://x/y.png"), cache).error


def test_cache_hit_and_invalidation(tmp_path: Path, cache: ProbeCache, monkeypatch):
    clip = tmp_path / "a.mp4"
    _write_clip(clip, n=8, fps=4)
    first = probe_file("video", str(clip), cache)
    calls = []
    real_open = av.open
    monkeypatch.setattr(av, "open", lambda *a, **k: calls.append(a) or real_open(*a, **k))
    assert probe_file("video", str(clip), cache) == first and not calls  # served from cache
    other = ProbeCache(cache.path)  # another process / connection sees the same rows
    assert probe_file("video", str(clip), other) == first and not calls
    _write_clip(clip, n=16, fps=8)
    st = clip.stat()
    os.utime(clip, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    again = probe_file("video", str(clip), cache)
    assert calls and again.num_frames == 16 and again.fps == 8.0


def test_frame_list_video(tmp_path: Path, cache: ProbeCache):
    for i in range(3):
        Image.new("RGB", (40, 28)).save(tmp_path / f"f{i}.png")
    ref = MediaRef("video", str(tmp_path / "f0.png"), tuple(str(tmp_path / f"f{i}.png") for i in range(3)), {"fps": 1.5})
    info = probe_media(ref, cache)
    assert info.ok and info.num_frames == 3 and info.fps == 1.5 and info.duration == 2.0
    Image.new("RGB", (20, 28)).save(tmp_path / "f2.png")
    assert "mixes frame sizes" in probe_media(ref, cache).error
