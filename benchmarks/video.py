"""Seek-decoding of sampled frames vs decoding every frame, per-backend frames/s, processor time per video.

Writes a 60 s, 30 fps, 240x432 H.264 clip with a keyframe every second (common for streamed short
videos) with PyAV, then:

  full decode   PyAV decodes every frame in order (frame threading on) and converts the 16 wanted ones
                to RGB (the baseline: what a reader without seeking does)
  seek decode   keye's probe (demux only) + sampled seek-decode of the same 16 frames
  backends      frames/s of the seek decode for every backend usable here
  processor     KeyeProcessor time per video message (preview and 1.5, 2 fps sampling)

Reports medians over repeats; the last line is the seek-vs-full speedup. Last line:
``speedup seek vs full decode: X.Xx``
Usage: python benchmarks/video.py [--repeats 5] [--seconds 60] [--full] [--quick]
       (``--quick``: an 8 s clip, one timing each)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``) and print one line per
    measurement; the last line is the speedup."""
    import av
    from _quick import parse_args

    from keye.processing.processor import KeyeProcessor
    from keye.processing.video import (
        VideoOptions,
        available_backends,
        decode_frames,
        probe_video,
        sample_frames,
    )
    from keye.testing.processor import make_test_video, make_tiny_processor_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--full", action="store_true", help="720p clip instead of 240x432")
    ap.add_argument("--seconds", type=int, default=60, help="clip length")
    args = parse_args(ap, argv, {"repeats": 1, "seconds": 8})
    size = (720, 1280) if args.full else (240, 432)
    n_frames = 30 * args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        clip = make_test_video(Path(tmp) / "clip.mp4", n_frames, fps=30, size=size, gop=30)
        print(f"wrote {args.seconds} s clip {size[1]}x{size[0]} @ 30 fps in {time.perf_counter() - t0:.1f} s")
        path = str(clip.path)
        probe = probe_video(path)
        plan = sample_frames(probe.timestamps, probe.fps, VideoOptions(nframes=16), "1.5")
        wanted = set(plan.indices)

        def full_decode() -> list[np.ndarray]:
            out = []
            with av.open(path) as c:
                s = c.streams.video[0]
                s.thread_type = "AUTO"
                for i, frame in enumerate(c.decode(s)):
                    if i in wanted:
                        out.append(frame.to_ndarray(format="rgb24"))
            return out

        def seek_decode(backend: str = "pyav") -> np.ndarray:
            p = probe_video(path)
            return decode_frames(p, plan.indices, backend)[0]

        assert len(full_decode()) == 16 and seek_decode().shape[0] == 16
        t_full = _median_time(full_decode, args.repeats)
        t_seek = _median_time(seek_decode, args.repeats)
        print(f"full decode ({n_frames} frames, keep 16): median {t_full * 1000:.1f} ms")
        print(f"seek decode (probe + 16 frames, pyav): median {t_seek * 1000:.1f} ms")
        for backend in available_backends():
            t = _median_time(lambda b=backend: seek_decode(b), args.repeats)
            print(
                f"backend {backend:10s}: {16 / t:8.1f} sampled frames/s (median {t * 1000:.1f} ms per video)"
            )
        for variant in ("preview", "1.5"):
            proc = KeyeProcessor.from_pretrained(
                make_tiny_processor_dir(Path(tmp) / variant, variant=variant)
            )
            msgs = [
                {
                    "role": "user",
                    "content": [{"type": "video", "video": path, "fps": 2.0}, {"type": "text", "text": "?"}],
                }
            ]
            batch = proc(msgs)
            t = _median_time(lambda p=proc, m=msgs: p(m), max(1, args.repeats // 2))
            tokens = batch.video_meta[0].tokens
            print(
                f"processor {variant:7s}: median {t * 1000:.0f} ms per {args.seconds} s video "
                f"({len(batch.video_meta[0].indices)} frames, {tokens} vision tokens)"
            )
    print(f"speedup seek vs full decode: {t_full / t_seek:.1f}x")


if __name__ == "__main__":
    main()
