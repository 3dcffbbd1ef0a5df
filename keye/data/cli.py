"""``keye data``: validate manifests, make the synthetic video-QA set, CLIP-filter image-text pairs.

::

    keye data check MANIFEST [--root DIR] [--processor DIR] [--json]
    keye data synth --out data/synth --train 20000 --test 1000 --seed 0 [--workers N] [--image-fraction 0.1]
                    [--warmup N] [--modes]
    keye data clip-filter MANIFEST --out KEPT.jsonl --checkpoint CLIP.pt --model ViT-B-32 --threshold 0.3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def add_commands(subparsers: Any) -> None:
    """Add ``keye data {check,synth,clip-filter}`` to the top-level ``keye`` parser."""
    data = subparsers.add_parser("data", help="training data: check manifests, synthetic set, CLIP filter")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data.set_defaults(func=lambda a: (data.print_help(), 2)[1])

    p = sub.add_parser("check", help="list every bad row of a manifest and summarise it (exit 1 if any is bad)")
    p.add_argument("manifest")
    p.add_argument("--root", default=None, help="directory media paths are relative to (default: manifest dir)")
    p.add_argument("--processor", default=None, help="processor/checkpoint dir for exact token counts")
    p.add_argument("--cache", default=None, help="probe cache file (default ~/.cache/keye/probe.sqlite)")
    p.add_argument("--max-rows", type=int, default=50, help="bad rows to print")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_check)

    p = sub.add_parser("synth", help="generate the synthetic video-QA set")
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, required=True)
    p.add_argument("--test", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs; 0 = in-process)")
    p.add_argument("--image-fraction", type=float, default=0.1, help="share of image-only samples")
    p.add_argument("--warmup", type=int, default=0,
                   help="also write N large-object caption images (warmup.jsonl, keye-tiny's perception stage)")
    p.add_argument("--modes", action="store_true",
                   help="add thinking-mode targets (think / no_think / auto) and write <split>_modes.jsonl")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_synth)

    p = sub.add_parser("clip-filter", help="keep image-text pairs whose CLIP score is above a threshold")
    p.add_argument("manifest")
    p.add_argument("--out", required=True, help="filtered manifest to write")
    p.add_argument("--model", default="ViT-B-32", help="open_clip architecture name")
    p.add_argument("--model-config", default=None, help="open_clip model config JSON (overrides --model)")
    p.add_argument("--checkpoint", required=True, help="local open_clip weights file")
    p.add_argument("--threshold", type=float, required=True)
    p.add_argument("--score", choices=("cosine", "clipscore"), default="cosine")
    p.add_argument("--text-from", choices=("assistant", "user", "all"), default="assistant")
    p.add_argument("--drop-non-pairs", action="store_true", help="drop rows that are not one image + text")
    p.add_argument("--root", default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_clip_filter)


def _check(args: argparse.Namespace) -> int:
    from keye.data.manifest import check_manifest
    from keye.data.probe import ProbeCache

    proc = None
    if args.processor:
        from keye.processing.processor import KeyeProcessor

        proc = KeyeProcessor.from_pretrained(args.processor)
    rep = check_manifest(args.manifest, args.root, processor=proc, cache=ProbeCache(args.cache))
    if args.json:
        bad = [{"line": b.line, "id": b.id, "reason": b.reason} for b in rep.bad_rows]
        print(json.dumps({"bad_rows": bad, "summary": rep.summary}, indent=2))
    else:
        print(rep.format(args.max_rows))
    return 1 if rep.bad_rows else 0


def _synth(args: argparse.Namespace) -> int:
    from keye.data.synth import generate

    t0 = time.perf_counter()
    paths = generate(
        args.out,
        train=args.train,
        test=args.test,
        seed=args.seed,
        workers=args.workers,
        image_fraction=args.image_fraction,
        progress=not args.no_progress,
        warmup=args.warmup,
        modes=args.modes,
    )
    dt = time.perf_counter() - t0
    n = args.train + args.test
    print(f"wrote {paths['train']} ({args.train}) and {paths['test']} ({args.test}) in {dt:.1f} s "
          f"({n / max(dt, 1e-9):.0f} samples/s)", file=sys.stderr)
    return 0


def _clip_filter(args: argparse.Namespace) -> int:
    from keye.data.clip_filter import ClipScorer, clip_filter_manifest

    scorer = ClipScorer.load(args.model, args.checkpoint, model_config=args.model_config, device=args.device)
    rep = clip_filter_manifest(
        args.manifest,
        args.out,
        scorer,
        threshold=args.threshold,
        root=args.root,
        score=args.score,
        text_from=args.text_from,
        drop_non_pairs=args.drop_non_pairs,
        batch_size=args.batch_size,
    )
    for b in rep.bad:
        print(f"bad: {b}", file=sys.stderr)
    print(rep.format())
    return 0
