"""Why keye-tiny misses the ``detail`` questions: where the tiny shape ends up in what the model sees.

A ``detail`` clip shows a tiny white shape (radius 6 % of the frame's short side, at least 5 px) for one
second among bigger shapes, and asks which of four shapes it is. Keye-VL-1.5's slow-fast split decides
the resolution of each sampled frame: a frame stays *fast* (30 % of a key frame's tokens) while at least
90 % of its 28 x 28 patches look like the last key frame's, and a shape that small changes only a patch or
two. This probe rebuilds each detail scene of a synthetic split (:func:`keye.data.synth.sample_scene`,
the exact scene of the manifest row), renders the clip and runs it through a checkpoint's processor
(keye-tiny's unless ``--model`` says otherwise; its video defaults plus the overrides below), and reads off
the processor's per-frame record which frames are key frames and at what size; it reports per clip:

* whether any frame showing the tiny shape is a key (slow) frame;
* the tiny shape's diameter in the resized frame the model gets, in pixels and in 14-px patches (the
  best frame: a slow one when there is one);
* with ``--eval <keye eval synth run folder>`` on the same split, whether the model answered it.

The overrides (``--max-pixels``, ``--min-frame-similarity``, ``--no-slow-fast``) answer "what if": the
same clips under a bigger per-frame budget, a key-frame rule that keeps more frames slow, or every frame a
key frame, without training anything. (Measured on seed 101's 25 detail clips with keye-tiny's defaults:
the tiny shape is in a key frame only in the 6 clips where it is there from the first frame, which is
always a key frame; even at ``--min-frame-similarity 1`` 11 of the 25 show it in fast frames only, the
patch it lands in staying similar enough to the key frame's. With the set's ``detail_cut`` option
(``--detail-cut``), where the distractors arrive with the tiny shape: in a key frame in 23 of 25, median
12.6 px across, 0.9 patches; seed 202: 17 of 18.)

Usage:
  python training/probe_detail.py --seed 101 --n 300 --eval runs/tiny/eval1
  python training/probe_detail.py --seed 101 --n 300 --max-pixels 50176
  python training/probe_detail.py --seed 101 --n 300 --detail-cut --position-weight 3
Writes ``<out>/detail_probe.json`` when ``--out`` is given; the last line is the summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

PATCH = 14


def load_processor(model: str) -> Any:
    """The processor of a checkpoint (``keye-tiny`` resolves to the embedded one): its ``video_defaults``
    are the video options the probe measures under, as the model sees its clips."""
    from keye.processing.processor import KeyeProcessor
    from keye.tiny import resolve_model_path

    return KeyeProcessor.from_pretrained(resolve_model_path(model))


def probe_scene(scene: Any, processor: Any, workdir: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Render one detail ``scene`` to ``workdir``, run it through ``processor`` (``overrides``: video item
    options on top of its defaults, e.g. ``{"max_pixels": 50176}``), and measure the tiny white shape (the
    scene's only white object; detail distractors are never white) in the frames that show it, from the
    processor's per-frame record (:class:`keye.processing.processor.VideoMeta`)."""
    from keye.data.synth import write_video

    tiny = [o for o in scene.objects if o.color == "white"]
    if scene.question_type != "detail" or len(tiny) != 1:
        raise ValueError(f"not a detail scene with one white shape: {scene.question_type!r}")
    tiny = tiny[0]
    path = workdir / "clip.mp4"
    write_video(path, scene)
    item = {"type": "video", "video": str(path), **(overrides or {})}
    meta = processor([{"role": "user", "content": [item, {"type": "text", "text": "?"}]}]).video_meta[0]
    showing = [j for j, t in enumerate(meta.timestamps) if tiny.t_appear <= t < tiny.t_vanish]
    if not showing:
        raise ValueError(f"no sampled frame shows the tiny shape ({tiny.t_appear}-{tiny.t_vanish} s)")
    slow_seen = any(meta.frame_types[j] == "slow" for j in showing)
    # the best frame showing it: a key frame when there is one
    best = next((j for j in showing if meta.frame_types[j] == "slow"), showing[0])
    seen_h, seen_w = (g * PATCH for g in meta.frame_grids[best][1:])
    diameter = 2 * tiny.size * seen_h / scene.height
    return {
        "frames": len(meta.frame_types), "key_frames": meta.frame_types.count("slow"),
        "frames_showing": len(showing), "slow_seen": slow_seen, "source_hw": [scene.height, scene.width],
        "seen_hw": [seen_h, seen_w], "diameter_px": round(diameter, 2), "diameter_patches": round(diameter / PATCH, 3),
        "tokens_of_frame": meta.frame_tokens[best],
    }


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts, median diameters and (where records carry ``correct``) accuracy, over all records and split
    by whether the tiny shape was seen in a key frame."""

    def part(rs: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"n": len(rs)}
        if rs:
            out["median_diameter_px"] = round(statistics.median(r["diameter_px"] for r in rs), 2)
            out["median_tokens_of_frame"] = statistics.median(r["tokens_of_frame"] for r in rs)
            judged = [r["correct"] for r in rs if "correct" in r]
            if judged:
                out["accuracy"] = round(100 * sum(judged) / len(judged), 1)
        return out

    return {"all": part(records), "seen in a key frame": part([r for r in records if r["slow_seen"]]),
            "fast frames only": part([r for r in records if not r["slow_seen"]])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, required=True, help="the synthetic set's seed (keye data synth --seed)")
    ap.add_argument("--split", default="test", choices=("train", "test"))
    ap.add_argument("--n", type=int, default=300, help="samples of the split to look at (detail ones are kept)")
    ap.add_argument("--model", default="keye-tiny", help="checkpoint whose video defaults to use")
    ap.add_argument("--max-pixels", type=int, default=None, help="override: per-frame pixel cap")
    ap.add_argument("--min-frame-similarity", type=float, default=None,
                    help="override: a frame stays fast while this share of its patches match the key frame")
    ap.add_argument("--no-slow-fast", action="store_true", help="override: every frame a key frame")
    ap.add_argument("--detail-cut", action="store_true",
                    help="the split was drawn with the detail_cut scene option (keye data synth --detail-cut)")
    ap.add_argument("--position-weight", type=float, default=1.0,
                    help="the split's position weight (keye data synth --position-weight): it decides which rows are detail")
    ap.add_argument("--eval", type=Path, default=None,
                    help="a `keye eval synth` run folder on the same split (its judgements.jsonl)")
    ap.add_argument("--out", type=Path, default=None, help="write <out>/detail_probe.json")
    args = ap.parse_args(argv)
    from keye.data.synth import sample_scene

    processor = load_processor(args.model)
    overrides: dict[str, Any] = {}
    for key, value in (("max_pixels", args.max_pixels), ("min_frame_similarity", args.min_frame_similarity)):
        if value is not None:
            overrides[key] = value
    if args.no_slow_fast:
        overrides["slow_fast"] = False
    judged: dict[str, bool] = {}
    if args.eval is not None:
        path = args.eval / "judgements.jsonl"
        if not path.is_file():
            raise SystemExit(f"{path}: not found (--eval takes a `keye eval synth` run folder)")
        judged = {j["id"]: bool(j["correct"]) for j in map(json.loads, path.read_text().splitlines())}
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.n):
            scene = sample_scene(args.seed, args.split, i, detail_cut=args.detail_cut,
                                 position_weight=args.position_weight)
            if scene.question_type != "detail":
                continue
            rec = {"id": f"{args.split}-{i:06d}", **probe_scene(scene, processor, Path(tmp), overrides)}
            if rec["id"] in judged:
                rec["correct"] = judged[rec["id"]]
            records.append(rec)
            print(json.dumps(rec), flush=True)
    if not records:
        raise SystemExit(f"no detail questions among the first {args.n} samples of seed {args.seed}")
    summary = summarise(records)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        options = {**processor.image_processor.config.video_defaults, **overrides}
        (args.out / "detail_probe.json").write_text(json.dumps(
            {"config": {k: str(v) for k, v in vars(args).items()}, "video_defaults": options,
             "summary": summary, "records": records}, indent=1))
    for name, part in summary.items():
        print(f"{name}: {json.dumps(part)}")
    s = summary["all"]
    print(f"detail clips {s['n']}: tiny shape in a key frame in {summary['seen in a key frame']['n']}, "
          f"median {s['median_diameter_px']} px across ({s['median_diameter_px'] / PATCH:.2f} patches)"
          + (f", accuracy {s['accuracy']} %" if "accuracy" in s else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
