"""Epoch planning time: the linear planner (keye.data.sampler) on 1,000,000 rows for 8 ranks, and its speed-up
over the earlier planner that rescanned the remaining queue every step (benchmarks/_plan_reference.py).

The rows are a Keye-VL-1.5-like mix made with numpy on the fly: 5 % long videos (8-30K tokens), 25 % short
videos (1-8K), 50 % images (0.3-3K), 20 % text (lognormal, 100-8K); cost = the cost model's forward FLOPs of
the LLM (keye.data.cost.llm_flops' formula) plus a vision term for the media tokens. Planning packs rows of
``--batch-tokens`` (32,768: Keye-VL-1.5's long-video stage) for ``--ranks`` data-parallel ranks.

Times are CPU seconds of this process (planning is single-threaded, so this is its wall time on an idle
core; on a shared machine the wall clock also counts other processes); medians over ``--repeats``. The old
planner is quadratic, so the ratio is taken on ``--compare-rows`` rows (50,000), where both planners also
must produce the same plan.
Usage: python benchmarks/plan_epoch.py [--rows 1000000] [--compare-rows 50000] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _plan_reference import BalancedSampler as OldSampler  # noqa: E402

from keye.data.cost import ModelDims  # noqa: E402
from keye.data.sampler import BalancedSampler  # noqa: E402


def mix(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64, FLOPs float64) of ``n`` rows of the mix in the module docstring."""
    rnd = np.random.default_rng(seed)
    kind = rnd.random(n)
    text = np.clip(rnd.lognormal(7.0, 0.9, n), 100, 8000).astype(np.int64)
    tokens = np.select(
        [kind < 0.05, kind < 0.30, kind < 0.80],
        [rnd.integers(8000, 30000, n), rnd.integers(1000, 8000, n), rnd.integers(300, 3000, n)],
        text,
    )
    media = np.where(kind < 0.80, tokens * 0.9, 0.0)
    d = ModelDims()
    s = tokens.astype(np.float64)
    per_layer = (2 * s * d.llm_hidden * (d.llm_heads + 2 * d.llm_kv_heads) * d.llm_head_dim
                 + 2 * s * d.llm_heads * d.llm_head_dim * d.llm_hidden + 6 * s * d.llm_hidden * d.llm_mlp
                 + 2 * s * s * d.llm_heads * d.llm_head_dim)
    llm = d.llm_layers * per_layer + 2 * s * d.llm_hidden * d.vocab_size
    patches = media * 4  # 2x2 merge: four patches per media token
    vision = d.vision_layers * (8.0 * patches * d.vision_hidden**2 + 4.0 * patches * d.vision_hidden * d.vision_mlp)
    return tokens, llm + vision


def cpu_time(make_plan) -> tuple[float, object]:
    """(CPU seconds, result) of one call."""
    t0 = time.process_time()
    out = make_plan()
    return time.process_time() - t0, out


def plan_new(tokens: np.ndarray, flops: np.ndarray, ranks: int, batch_tokens: int) -> object:
    """The linear planner's epoch-0 plan (sampler built inside: its set-up is part of planning)."""
    return BalancedSampler(tokens, flops, world_size=ranks, rank=0, batch_tokens=batch_tokens, seed=1).plan(0)


def plan_old(tokens: np.ndarray, flops: np.ndarray, ranks: int, batch_tokens: int) -> object:
    """The earlier planner's epoch-0 plan (Python lists in, as it took them)."""
    return OldSampler(tokens.tolist(), flops.tolist(), world_size=ranks, rank=0, batch_tokens=batch_tokens,
                      seed=1).plan(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--compare-rows", type=int, default=50_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="20,000 rows, the comparison on 4,000, one repeat")
    args = ap.parse_args()
    rows, small, reps = (20_000, 4_000, 1) if args.quick else (args.rows, args.compare_rows, args.repeats)

    tokens, flops = mix(small)
    new_t, old_t = [], []
    for _ in range(reps):
        t, new_plan = cpu_time(lambda: plan_new(tokens, flops, args.ranks, args.batch_tokens))
        new_t.append(t)
        t, old_plan = cpu_time(lambda: plan_old(tokens, flops, args.ranks, args.batch_tokens))
        old_t.append(t)
    same = [(s.ranks, s.overfull) for s in new_plan.steps] == [(s.ranks, s.overfull) for s in old_plan.steps]
    print(f"{small} rows: old planner {statistics.median(old_t):.2f} s, linear planner "
          f"{statistics.median(new_t):.3f} s (median of {reps}); same plan: {'yes' if same else 'NO'}")

    tokens, flops = mix(rows)
    big = []
    for _ in range(reps):
        t, plan = cpu_time(lambda: plan_new(tokens, flops, args.ranks, args.batch_tokens))
        big.append(t)
        print(f"  {rows} rows: {t:.2f} s, {plan.n_steps} steps")
    ratio = statistics.median(old_t) / statistics.median(new_t)
    print(f"epoch plan of {rows} rows for {args.ranks} ranks: {statistics.median(big):.2f} s (target < 10 s); "
          f"at {small} rows {ratio:.1f}x faster than the old planner (same plan: {'yes' if same else 'NO'})")


if __name__ == "__main__":
    main()
