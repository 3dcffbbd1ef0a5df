"""Recipe: make the synthetic video-QA set and validate it.

    python data/make_synth.py                       # data/synth: 20000 train + 1000 test, seed 0
    python data/make_synth.py --train 2000 --test 200 --out /tmp/synth_small

Equivalent to ``keye data synth ...`` followed by ``keye data check`` on both splits.
"""

from __future__ import annotations

import argparse
import time

from keye.data.manifest import check_manifest
from keye.data.synth import generate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/synth")
    ap.add_argument("--train", type=int, default=20000)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--image-fraction", type=float, default=0.1)
    args = ap.parse_args()
    t0 = time.perf_counter()
    paths = generate(
        args.out, train=args.train, test=args.test, seed=args.seed, workers=args.workers,
        image_fraction=args.image_fraction,
    )
    print(f"generated in {time.perf_counter() - t0:.1f} s")
    bad = 0
    for split, path in paths.items():
        rep = check_manifest(path)
        bad += len(rep.bad_rows)
        print(f"--- {split}: {path}\n{rep.format()}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
