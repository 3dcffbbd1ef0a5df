"""Vision tokens of a mostly static 60 s clip with slow-fast frames vs all frames slow (same slow size).

Writes a 60 s, 10 fps, 360x640 clip whose picture changes only at two scene cuts (20 s and 40 s; a thin
frame-index strip changes every frame), samples it at 2 fps with the Keye-VL-1.5 rules and runs the
processor twice: ``slow_fast`` on (the 1.5 default) and off. Both runs budget the same way; with so few
frames the budget does not bind, so the slow frames have the same resolution in both and the saving comes
only from fast frames at ~30 % of the tokens. Also reports the classification time (median).

The last line is the token ratio all-slow / slow-fast. Last line: ``vision tokens all-slow vs slow-fast: X.XXx``
Usage: python benchmarks/slowfast.py [--repeats 3] [--seconds 60] [--quick]
       (``--quick``: a 12 s clip with its cuts at 4 s and 8 s, one timing)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark with the command line ``argv`` (``None``: ``sys.argv[1:]``); the last printed line is the
    token ratio."""
    import torch
    from _quick import parse_args

    from keye.processing.processor import KeyeProcessor
    from keye.processing.slowfast import classify_frames
    from keye.processing.video import VideoOptions, fetch_video
    from keye.testing.processor import make_test_video, make_tiny_processor_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=60, help="clip length (scene cuts at 1/3 and 2/3 of it)")
    args = parse_args(ap, argv, {"repeats": 1, "seconds": 12})
    frames = 10 * args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        clip = make_test_video(
            Path(tmp) / "static.mp4",
            frames,
            fps=10,
            size=(360, 640),
            pattern="scenes",
            scene_cuts=[frames // 3, 2 * frames // 3],
            gop=50,
        )
        print(f"wrote mostly static {args.seconds} s clip 640x360 @ 10 fps in {time.perf_counter() - t0:.1f} s")
        proc = KeyeProcessor.from_pretrained(make_tiny_processor_dir(Path(tmp) / "p15", variant="1.5"))
        item = {"type": "video", "video": str(clip.path), "fps": 2.0}
        on = proc([{"role": "user", "content": [item]}]).video_meta[0]
        off = proc([{"role": "user", "content": [{**item, "slow_fast": False}]}]).video_meta[0]
        n_slow = on.frame_types.count("slow")
        print(f"sampled frames: {len(on.indices)}; slow {n_slow}, fast {len(on.indices) - n_slow}")
        print(
            f"slow-fast: slow {on.extra['slow_hw'][0]}x{on.extra['slow_hw'][1]}, fast "
            f"{on.extra['fast_hw'][0]}x{on.extra['fast_hw'][1]}, {on.tokens} vision tokens"
        )
        print(
            f"all-slow : slow {off.extra['slow_hw'][0]}x{off.extra['slow_hw'][1]}, {off.tokens} vision tokens"
        )
        assert on.extra["slow_hw"] == off.extra["slow_hw"], "budget bound: slow sizes differ"
        video = fetch_video(str(clip.path), VideoOptions(fps=2.0), "1.5")
        frames = torch.from_numpy(video.frames).permute(0, 3, 1, 2)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            classify_frames(frames)
            times.append(time.perf_counter() - t0)
        print(
            f"slow/fast classification of {len(frames)} frames: median {statistics.median(times) * 1000:.0f} ms"
        )
    print(f"vision tokens all-slow vs slow-fast: {off.tokens / on.tokens:.2f}x")


if __name__ == "__main__":
    main()
