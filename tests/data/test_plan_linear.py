"""The linear epoch planner: the same plan as the earlier (quadratic) planner kept in
benchmarks/_plan_reference.py, the rest of a resumed epoch (``done`` / ``limit``), and packing at long budgets."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from keye.data.balance import balance, lpt
from keye.data.sampler import BalancedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _plan_reference import BalancedSampler as OldSampler  # noqa: E402
from _plan_reference import balance as old_balance  # noqa: E402


def _mix(n: int, seed: int) -> tuple[list[int], list[float]]:
    rnd = random.Random(seed)
    tokens = [rnd.choice([rnd.randint(1500, 3800), rnd.randint(200, 900), rnd.randint(20, 120)]) for _ in range(n)]
    costs = [t * (4.0 if t > 1000 else 1.0) + rnd.random() for t in tokens]
    return tokens, costs


MODES = [
    dict(batch_size=3),
    dict(batch_size=4, micro_batches=3, length_grouped=True),
    dict(batch_size=2, micro_batches=2),
    dict(batch_tokens=4096),  # tight: many units are deferred to the next step
    dict(batch_tokens=4096, micro_batches=2),
    dict(batch_tokens=6000, micro_batches=3, fill=1.0),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()))
def test_same_plan_as_the_earlier_planner(mode: dict):
    checked = 0
    for seed, n, world, group in [(0, 157, 2, 1), (1, 300, 4, 1), (2, 211, 3, 3), (3, 90, 8, 1), (4, 64, 1, 2)]:
        tokens, costs = _mix(n, seed)
        groups = [i // group for i in range(n)] if group > 1 else None
        kw = dict(world_size=world, rank=0, seed=seed, exclude=[5, 17], groups=groups, **mode)
        old = OldSampler(tokens, costs, **kw)
        new = BalancedSampler(tokens, costs, **kw)
        for epoch in (0, 1):
            a, b = old.plan(epoch), new.plan(epoch)
            assert [(s.ranks, s.overfull) for s in a.steps] == [(s.ranks, s.overfull) for s in b.steps]
            assert [b.rank_micro_batches(r) for r in range(world)] == [a.rank_micro_batches(r) for r in range(world)]
        assert new.too_long == old.too_long
        checked += 1
    assert checked == 5


def test_balance_equals_the_earlier_balancer_on_ties_and_groups():
    rnd = random.Random(7)
    for _ in range(40):
        n = rnd.randint(4, 40)
        costs = [float(rnd.choice([1, 2, 3, 5, 8, rnd.uniform(0, 50)])) for _ in range(n)]  # many equal costs
        ranks = rnd.randint(2, 5)
        groups = [rnd.randint(0, n // 2) for _ in range(n)] if rnd.random() < 0.5 else None
        if len(set(groups or range(n))) < ranks:
            continue
        assert balance(costs, ranks, groups=groups) == old_balance(costs, ranks, groups=groups)


def _all(plan, world):
    return sorted(i for r in range(world) for mb in plan.rank_micro_batches(r) for i in mb)


def test_consumed_and_the_rest_of_an_epoch_on_another_layout():
    tokens, costs = _mix(120, 5)
    two = BalancedSampler(tokens, costs, world_size=2, rank=0, batch_tokens=4096, micro_batches=2, seed=3)
    plan = two.plan(4)
    for position in (0, 1, 3, 4, 2 * plan.n_steps):
        done = plan.consumed(position)
        expect = sorted(i for r in range(2) for mb in plan.rank_micro_batches(r)[:position] for i in mb)
        assert done.tolist() == expect
        for world in (1, 3):
            other = BalancedSampler(tokens, costs, world_size=world, rank=0, batch_tokens=4096, micro_batches=2, seed=3)
            rest = other.plan(4, done=done)
            assert sorted(_all(rest, world) + expect) == list(range(120))  # each sample exactly once
            counts = {len(rest.rank_micro_batches(r)) for r in range(world)}
            assert len(counts) == 1  # lock-step
    # Nothing left: an empty plan; a single sample left for 3 ranks: one step, empty micro-batches elsewhere.
    assert two.plan(4, done=np.arange(120)).n_steps == 0
    three = BalancedSampler(tokens, costs, world_size=3, rank=0, batch_tokens=4096, micro_batches=2, seed=3)
    tail = three.plan(4, done=np.arange(119))
    assert tail.n_steps == 1 and _all(tail, 3) == [119]
    assert sum(1 for r in range(3) for mb in tail.rank_micro_batches(r) if not mb) == 5


def test_limit_keeps_the_epoch_of_the_rows_it_started_with():
    tokens, costs = _mix(150, 6)
    before = BalancedSampler(tokens[:100], costs[:100], world_size=2, rank=0, batch_size=3, seed=2)
    grown = BalancedSampler(tokens, costs, world_size=2, rank=0, batch_size=3, seed=2)
    a, b = before.plan(1), grown.plan(1, limit=100)
    assert [s.ranks for s in a.steps] == [s.ranks for s in b.steps]
    assert _all(grown.plan(2), 2) == list(range(150))  # the new rows join from the next epoch


def test_packing_fills_rows_of_32k_tokens():
    """Long-video rows: samples of 1-20K tokens packed into 32,768-token micro-batches, never over the budget
    (but the last step), and full enough to be worth it."""
    rnd = np.random.default_rng(0)
    tokens = np.concatenate([rnd.integers(8_000, 20_000, 60), rnd.integers(1_000, 8_000, 300),
                             rnd.integers(100, 1_000, 400)])
    s = BalancedSampler(tokens, tokens.astype(float) ** 1.2, world_size=4, rank=0, batch_tokens=32_768,
                        micro_batches=2, seed=0)
    plan = s.plan(0)
    loads = [int(tokens[mb].sum()) for st in plan.steps[:-1] for r in st.ranks for mb in r]
    assert max(loads) <= 32_768 and not plan.overfull[:-1].any()
    assert np.median(loads) / 32_768 >= 0.8
    assert _all(plan, 4) == list(range(len(tokens)))
    # The same sizes fit 8K and 128K rows too (a 20K sample is too long for 8K and is reported).
    assert BalancedSampler(tokens, tokens * 1.0, world_size=2, batch_tokens=8192).too_long == \
        np.flatnonzero(tokens > 8192).tolist()
    big = BalancedSampler(tokens, tokens * 1.0, world_size=2, batch_tokens=131_072).plan(0)
    assert max(int(tokens[mb].sum()) for st in big.steps for r in st.ranks for mb in r) <= 131_072


def test_lpt_unchanged_worked_example():
    assert lpt([5, 7, 3, 6, 4], 2) == [[1, 4, 2], [3, 0]]
