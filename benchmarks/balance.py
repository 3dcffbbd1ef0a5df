"""Dynamic load balancing: max/mean per-rank compute of one global step, ours vs two baselines.

A realistic Keye-VL-1.5 global batch (8 ranks x 32 samples): long videos (2-10 min), short videos
(5-60 s), images (0.3-4 MP) and text-only samples (share 5/25/50/20 %). Each sample's tokens and FLOPs come
from the processor's 1.5 sizing rules (2 fps sampling, slow/fast budgets; 30-70 % fast frames) and the
cost model's Keye-VL-8B FLOPs formulas (keye.data.cost). Strategies:

  random       shuffle, equal sample counts per rank
  token-count  sorted greedy (LPT) on token counts only (verl-style `_balance_batch`)
  ours         LPT on estimated FLOPs + pairwise swap refinement (keye.data.balance.balance)

Prints the median over steps of max/mean per-rank FLOPs; the last line is ours. Target: <= 1.05.
Usage: python benchmarks/balance.py [--steps 50] [--full] [--quick]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from keye.data.balance import balance, imbalance, lpt
from keye.data.cost import ModelDims, llm_flops, vision_flops
from keye.processing.image import V1_5, image_grid_for_size
from keye.processing.slowfast import slowfast_sizes

DIMS = ModelDims()
RESOLUTIONS = [(360, 640), (480, 854), (720, 1280), (1080, 1920), (1080, 1080), (1920, 1080)]


def video_sample(rnd: random.Random, seconds: float) -> tuple[int, float]:
    """(tokens, FLOPs) of a 1.5 video of ``seconds`` at 2 fps sampling with a random slow/fast split."""
    h, w = rnd.choice(RESOLUTIONS)
    n = min(int(seconds * 2.0), 1365)
    n_fast = int(n * rnd.uniform(0.3, 0.7))
    n_slow = max(1, n - n_fast)
    sz = slowfast_sizes(n_slow, n - n_slow, h, w)
    slow_p = (sz.slow_hw[0] // 14) * (sz.slow_hw[1] // 14)
    fast_p = (sz.fast_hw[0] // 14) * (sz.fast_hw[1] // 14)
    segments = [slow_p] * n_slow + [fast_p] * (n - n_slow)
    ts_tokens = 4  # "<|frame|>" + about three timestamp digit tokens per frame
    tokens = sz.total_tokens + n * ts_tokens + 2 * (n - n_slow) + rnd.randint(30, 300)
    return tokens, vision_flops(segments, DIMS) + llm_flops(tokens, DIMS)


def image_sample(rnd: random.Random) -> tuple[int, float]:
    """(tokens, FLOPs) of one image question of 0.3-4 MP."""
    mp = rnd.uniform(0.3, 4.0) * 1e6
    aspect = rnd.uniform(0.5, 2.0)
    h, w = int((mp / aspect) ** 0.5), int((mp * aspect) ** 0.5)
    _, gh, gw = image_grid_for_size(h, w, V1_5)
    tokens = gh * gw // 4 + rnd.randint(30, 600)
    return tokens, vision_flops([gh * gw], DIMS) + llm_flops(tokens, DIMS)


def text_sample(rnd: random.Random) -> tuple[int, float]:
    """(tokens, FLOPs) of a text-only sample of 100-8000 tokens."""
    tokens = int(rnd.lognormvariate(7.0, 0.9))
    tokens = max(100, min(tokens, 8000))
    return tokens, llm_flops(tokens, DIMS)


def global_batch(rnd: random.Random, n: int) -> tuple[list[int], list[float]]:
    """``n`` samples of the mix: 5 % long video, 25 % short video, 50 % image, 20 % text."""
    toks, flops = [], []
    for _ in range(n):
        u = rnd.random()
        if u < 0.05:
            t, f = video_sample(rnd, rnd.uniform(120, 600))
        elif u < 0.30:
            t, f = video_sample(rnd, rnd.uniform(5, 60))
        elif u < 0.80:
            t, f = image_sample(rnd)
        else:
            t, f = text_sample(rnd)
        toks.append(t)
        flops.append(f)
    return toks, flops


def random_split(n: int, ranks: int, rnd: random.Random) -> list[list[int]]:
    """Shuffle and cut into ``ranks`` equal-count chunks (the usual DistributedSampler outcome)."""
    idx = list(range(n))
    rnd.shuffle(idx)
    return [idx[r::ranks] for r in range(ranks)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50, help="global steps (independent batches) to measure")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--per-rank", type=int, default=32)
    ap.add_argument("--full", action="store_true", help="500 steps")
    ap.add_argument("--quick", action="store_true", help="3 steps (checks the script runs)")
    args = ap.parse_args()
    steps = 3 if args.quick else 500 if args.full else args.steps
    rnd = random.Random(0)
    res: dict[str, list[float]] = {"random": [], "token-count": [], "ours (LPT only)": [], "ours": []}
    t_ours = []
    for _ in range(steps):
        toks, flops = global_batch(rnd, args.ranks * args.per_rank)
        res["random"].append(imbalance(flops, random_split(len(flops), args.ranks, rnd)))
        res["token-count"].append(imbalance(flops, lpt(toks, args.ranks)))
        res["ours (LPT only)"].append(imbalance(flops, lpt(flops, args.ranks)))
        t0 = time.perf_counter()
        ours = balance(flops, args.ranks)
        t_ours.append(time.perf_counter() - t0)
        res["ours"].append(imbalance(flops, ours))
    print(f"{steps} global steps of {args.ranks} ranks x {args.per_rank} samples "
          f"(5% long video, 25% short video, 50% image, 20% text); median max/mean per-rank FLOPs:")
    for name, vals in res.items():
        print(f"  {name:<16} {statistics.median(vals):.4f}   (worst step {max(vals):.4f})")
    print(f"balancer time per step: {statistics.median(t_ours) * 1e3:.2f} ms")
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"max/mean per-rank cost, ours: {med['ours']:.4f} (token-count-only {med['token-count']:.4f}, "
          f"random {med['random']:.4f})")


if __name__ == "__main__":
    main()
