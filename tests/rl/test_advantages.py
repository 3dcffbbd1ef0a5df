"""Group advantages with and without replay, hand-computed (values derived in the comments)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.algorithms.advantages import (
    DifficultyCurve,
    difficulty_reshape,
    group_advantages,
    group_pass_rate,
    rlep_advantages,
)

EPS = 1e-6


def test_grpo_unbiased_vs_population_std():
    # rewards [1, 0, 0, 1]: mean 0.5, deviations +-0.5, sum of squares 1.0
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    g = torch.zeros(4, dtype=torch.long)
    unbiased = group_advantages(r, g, std="unbiased", eps=EPS)  # std = sqrt(1/3)
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    torch.testing.assert_close(unbiased, torch.tensor([a, -a, -a, a], dtype=torch.float64))
    population = group_advantages(r, g, std="population", eps=EPS)  # std = sqrt(1/4) = 0.5
    b = 0.5 / (0.5 + EPS)
    torch.testing.assert_close(population, torch.tensor([b, -b, -b, b], dtype=torch.float64))


def test_dr_grpo_no_std_and_several_groups_in_any_order():
    # group 7: [1, 0, 0] -> mean 1/3; group 2: [2, 4] -> mean 3, interleaved on purpose
    r = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0], dtype=torch.float64)
    g = torch.tensor([7, 2, 7, 2, 7])
    adv = group_advantages(r, g, std="none")
    expect = torch.tensor([2 / 3, -1.0, -1 / 3, 1.0, -1 / 3], dtype=torch.float64)
    torch.testing.assert_close(adv, expect)


def test_singleton_group_follows_reference_convention():
    # one member: mean 0, std 1 -> A = r / (1 + eps)
    adv = group_advantages(torch.tensor([0.7]), torch.tensor([0]), eps=EPS)
    torch.testing.assert_close(adv, torch.tensor([0.7 / (1 + EPS)]))


def test_rlep_all_fail_group_gets_signal_from_replay():
    # fresh [-1, -1, -1] + replay [+1, +1]: mean -0.2, deviations -0.8 (x3) and 1.2 (x2),
    # sum of squares 3*0.64 + 2*1.44 = 4.8, unbiased variance 4.8/4 = 1.2
    fresh = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    replay = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    fa, ra = rlep_advantages(fresh, replay, std="unbiased", eps=EPS)
    sd = math.sqrt(1.2) + EPS
    torch.testing.assert_close(fa, torch.full((1, 3), -0.8 / sd, dtype=torch.float64))
    torch.testing.assert_close(ra, torch.full((1, 2), 1.2 / sd, dtype=torch.float64))
    # without replay the same fresh group carries no signal at all
    fa0, ra0 = rlep_advantages(fresh, None)
    assert torch.equal(fa0, torch.zeros_like(fa0)) and ra0.shape == (1, 0)


def test_rlep_missing_slot_is_masked_not_an_empty_failure():
    # fresh [-1, -1, -1], replay [+1, missing]. Masked: group of 4, mean -0.5, deviations -0.5 (x3), 1.5,
    # sum of squares 0.75 + 2.25 = 3, unbiased variance 1 -> A = -0.5 / (1 + eps), 1.5 / (1 + eps), 0.
    fresh = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    replay = torch.tensor([[1.0, 123.0]], dtype=torch.float64)  # the missing slot's value must not matter
    valid = torch.tensor([[True, False]])
    fa, ra = rlep_advantages(fresh, replay, valid, eps=EPS)
    torch.testing.assert_close(fa, torch.full((1, 3), -0.5 / (1 + EPS), dtype=torch.float64))
    torch.testing.assert_close(ra, torch.tensor([[1.5 / (1 + EPS), 0.0]], dtype=torch.float64))
    # the reference's empty-response filling would score the slot -1: mean -0.6, a different result
    fb, _ = rlep_advantages(fresh, torch.tensor([[1.0, -1.0]], dtype=torch.float64))
    assert not torch.allclose(fa, fb)


def test_rlep_all_success_group_stays_zero_and_rows_are_independent():
    fresh = torch.tensor([[1.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    replay = torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    fa, ra = rlep_advantages(fresh, replay, eps=EPS)
    assert torch.equal(fa[0], torch.zeros(2, dtype=torch.float64)) and torch.equal(ra[0], torch.zeros(2, dtype=torch.float64))
    # row 1: [0, 1, 1, 1] mean 0.75, deviations -0.75, 0.25 x3, sum sq 0.5625 + 0.1875 = 0.75, var 0.25
    sd = 0.5 + EPS
    torch.testing.assert_close(fa[1], torch.tensor([-0.75 / sd, 0.25 / sd], dtype=torch.float64))
    torch.testing.assert_close(ra[1], torch.tensor([0.25 / sd, 0.25 / sd], dtype=torch.float64))


def test_bad_inputs_raise_typed_errors():
    with pytest.raises(KeyeConfigError):
        group_advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), std="sample")
    with pytest.raises(KeyeInputError):
        group_advantages(torch.zeros(2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(KeyeInputError):
        group_advantages(torch.tensor([float("nan"), 1.0]), torch.zeros(2, dtype=torch.long))
    with pytest.raises(KeyeInputError):
        rlep_advantages(torch.zeros(2, 3), torch.zeros(3, 2))


def test_difficulty_curve_interpolation_and_presets():
    curve = DifficultyCurve.from_config("mixed_up")  # (0,1) (0.5,1.5) (0.875,1) (1,0.5)
    rates = torch.tensor([0.0, 0.25, 0.5, 0.875, 0.9375, 1.0])
    torch.testing.assert_close(curve(rates), torch.tensor([1.0, 1.25, 1.5, 1.0, 0.75, 0.5]))
    custom = DifficultyCurve.from_config([[0, 0], [1, 2]])
    torch.testing.assert_close(custom(torch.tensor([0.3])), torch.tensor([0.6]))
    with pytest.raises(KeyeConfigError):
        DifficultyCurve.from_config([[0.1, 1], [1, 1]])  # must start at 0
    with pytest.raises(KeyeConfigError):
        DifficultyCurve.from_config("steep")


def test_difficulty_reshape_uses_fresh_pass_rate_only():
    # group 0: fresh passed [T, F, F, F] (rate 0.25 -> scale 1.25 under mixed_up) + 2 replay successes
    # that must not raise the rate; group 1: fresh [T, T, T, T] (rate 1 -> 0.5)
    passed = torch.tensor([1, 0, 0, 0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    groups = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
    fresh = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    rate = group_pass_rate(passed, groups, fresh)
    torch.testing.assert_close(rate, torch.tensor([0.25] * 6 + [1.0] * 4))
    adv = torch.arange(10, dtype=torch.float32)
    out, scale = difficulty_reshape(adv, passed, groups, "mixed_up", counted=fresh)
    torch.testing.assert_close(scale, torch.tensor([1.25] * 6 + [0.5] * 4))
    torch.testing.assert_close(out, adv * scale)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.floats(-3, 3, allow_nan=False), st.booleans()), min_size=1, max_size=24),
       st.sampled_from(["unbiased", "population", "none"]))
def test_matches_a_per_group_python_oracle(rows, std):
    # independent oracle: statistics.stdev / pstdev over each group's valid members
    groups = torch.tensor([g for g, _, _ in rows])
    rewards = torch.tensor([r for _, r, _ in rows], dtype=torch.float64)
    valid = torch.tensor([v for _, _, v in rows])
    adv = group_advantages(rewards, groups, valid, std=std, eps=EPS)
    for i, (g, r, v) in enumerate(rows):
        members = [rr for gg, rr, vv in rows if gg == g and vv]
        if not v:
            expect = 0.0
        elif len(members) == 1:
            expect = r if std == "none" else r / (1 + EPS)
        else:
            mu = statistics.fmean(members)
            if std == "none":
                expect = r - mu
            else:
                sd = statistics.stdev(members) if std == "unbiased" else statistics.pstdev(members)
                expect = (r - mu) / (sd + EPS)
        assert float(adv[i]) == pytest.approx(expect, rel=1e-9, abs=1e-7)
