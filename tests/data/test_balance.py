"""Balancer and packing: exactly-once, optimality checks against brute force, groups, budgets."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keye.data.balance import balance, imbalance, lpt
from keye.data.packing import length_buckets, pack_ffd, split_into_bins
from keye.errors import KeyeConfigError


def _brute_best_max(costs: list[float], n: int) -> float:
    best = float("inf")
    for assign in itertools.product(range(n), repeat=len(costs)):
        loads = [0.0] * n
        for c, r in zip(costs, assign):
            loads[r] += c
        best = min(best, max(loads))
    return best


def test_lpt_worked_example():
    # Sorted 7,6,5,4,3 (indices 1,3,0,4,2) to the least-loaded of 2 bins:
    # 7->A, 6->B, 5->B (6<7), 4->A (7<11), 3->A (11=11, lower bin id wins)
    assert lpt([5, 7, 3, 6, 4], 2) == [[1, 4, 2], [3, 0]]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=3, max_size=8), st.integers(2, 3))
def test_refined_matches_brute_force_on_small_cases(costs, n):
    if len(costs) < n:
        return
    got = balance(costs, n)
    assert sorted(i for b in got for i in b) == list(range(len(costs)))
    best = _brute_best_max(costs, n)
    got_max = max(sum(costs[i] for i in b) for b in got)
    # LPT is a 4/3-approximation; pairwise refinement must never be worse than plain LPT.
    lpt_max = max(sum(costs[i] for i in b) for b in lpt(costs, n))
    assert best <= got_max <= lpt_max <= 4 / 3 * best + 1e-9


def test_refinement_fixes_classic_lpt_failure():
    # LPT on {3,3,2,2,2} over 2 bins gives 7/5; the optimum is 6/6.
    costs = [3, 3, 2, 2, 2]
    assert max(sum(costs[i] for i in b) for b in lpt(costs, 2)) == 7
    assert max(sum(costs[i] for i in b) for b in balance(costs, 2)) == 6


def test_groups_stay_together_and_deterministic():
    rnd = random.Random(5)
    costs = [rnd.uniform(1, 100) for _ in range(64)]
    groups = [i // 8 for i in range(64)]
    a = balance(costs, 4, groups=groups)
    assert a == balance(costs, 4, groups=groups)
    for b in a:
        assert {groups[i] for i in b} and all(len([i for i in b if groups[i] == g]) == 8 for g in {groups[i] for i in b})
    assert sorted(i for b in a for i in b) == list(range(64))


def test_min_per_rank_and_imbalance():
    costs = [1000, 900, 1, 1, 1, 1]
    a = balance(costs, 2, min_per_rank=3)
    assert all(len(b) >= 3 for b in a)
    assert imbalance([1, 1], [[0], [1]]) == 1.0
    with pytest.raises(KeyeConfigError):
        balance([1, 2], 3)


def test_realistic_mix_is_within_five_percent():
    rnd = random.Random(0)
    costs = [rnd.choice([rnd.uniform(40, 90), rnd.uniform(4, 12), rnd.uniform(0.5, 2), 0.1]) for _ in range(256)]
    assert imbalance(costs, balance(costs, 8)) <= 1.05


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=40), st.integers(100, 300))
def test_pack_ffd_never_splits_and_respects_budget(lengths, budget):
    rows = pack_ffd(lengths, budget)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= budget for r in rows)
    # FFD's 11/9 OPT bound cannot be checked against a lower bound of OPT (lengths [29, 29, 43, 72, 72, 72, 72]
    # in rows of 100 need 6 rows, optimally, while the bounds give 4). What first-fit does guarantee: a new row
    # opens only when the item fits in no open row, so any two rows together exceed the budget, hence fewer
    # than 2 * total / budget + 1 rows.
    loads = sorted(sum(lengths[i] for i in r) for r in rows)
    assert len(loads) < 2 or loads[0] + loads[1] > budget
    assert len(rows) < 2 * sum(lengths) / budget + 1


def test_pack_and_bucket_errors_and_shapes():
    with pytest.raises(KeyeConfigError, match="more than the row budget"):
        pack_ffd([5, 20], 10)
    assert pack_ffd([6, 5, 4, 5], 10) == [[0, 2], [1, 3]]
    b = length_buckets([10, 500, 20, 510, 30], batch_size=2, bucket_width=256)
    assert b == [[0, 2], [4], [1, 3]]
    bt = length_buckets([100, 100, 100, 300], batch_tokens=300, bucket_width=1000)
    assert bt == [[0, 1, 2], [3]]
    # 5->b0, 4->b1, 3->b1 (lighter, fits: 7), 2->b0 (7), 1->b0 (tie 7/7, lower id; 8 <= 8)
    assert split_into_bins([5, 4, 3, 2, 1], 2, sizes=[5, 4, 3, 2, 1], capacity=8) == ([[0, 3, 4], [1, 2]], [])
    # Capacity 7 holds only 14 of the 15 tokens: the last (smallest) item overflows.
    assert split_into_bins([5, 4, 3, 2, 1], 2, sizes=[5, 4, 3, 2, 1], capacity=7)[1] == [4]
    bins, over = split_into_bins([9, 9, 9], 2, sizes=[9, 9, 9], capacity=10)
    assert over == [2]
