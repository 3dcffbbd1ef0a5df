"""Recipe: CLIP-score filtering of an image-caption manifest (Keye-VL §3.1 data-quality filter).

    python data/clip_filter.py captions.jsonl --out captions.clip.jsonl \
        --model ViT-L-14 --checkpoint /models/open_clip/ViT-L-14.pt --threshold 0.28

Keye keeps pairs above a CLIP-score threshold and sends the rest to re-captioning; this writes the kept
rows (with ``clip_score``) to ``--out`` and, with ``--rejected``, the dropped pair rows to a second file so
they can be re-captioned. The checkpoint must be a local file: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from keye.data.clip_filter import ClipScorer, clip_filter_manifest, rebase_row
from keye.data.manifest import read_manifest, write_manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifest")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rejected", default=None, help="also write the dropped pair rows here")
    ap.add_argument("--model", default="ViT-B-32")
    ap.add_argument("--model-config", default=None)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--threshold", type=float, required=True)
    ap.add_argument("--score", choices=("cosine", "clipscore"), default="cosine")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    scorer = ClipScorer.load(args.model, args.checkpoint, model_config=args.model_config, device=args.device)
    rep = clip_filter_manifest(
        args.manifest, args.out, scorer, threshold=args.threshold, score=args.score, batch_size=args.batch_size
    )
    print(rep.format())
    for b in rep.bad:
        print(f"bad: {b}")
    if args.rejected:
        kept = {s.id for s in read_manifest(args.out).samples}
        src = read_manifest(args.manifest)
        out_dir = Path(args.rejected).resolve().parent
        dropped = [
            rebase_row(s.row, s, out_dir) for s in src.samples
            if s.id not in kept and len(s.media) == 1 and s.media[0].kind == "image"
            and all(b.line != s.line for b in rep.bad)
        ]
        write_manifest(args.rejected, dropped)
        print(f"wrote {len(dropped)} rejected pairs to {args.rejected}")
    print(json.dumps({"kept": rep.kept, "dropped": rep.dropped, "bad": len(rep.bad)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
