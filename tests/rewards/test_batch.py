"""Batch API (list in, list out) and per-part statistics for the RL trainer."""

from __future__ import annotations

import pytest

from keye.errors import KeyeInputError
from keye.rewards import RewardResult, RewardSpec, aggregate_stats, score, score_batch

SPEC = RewardSpec(format=1.0, accuracy=1.0, overlong=1.0)


def test_batch_equals_per_item_scores() -> None:
    responses = ["<think>a</think>\\boxed{4}", "<think>a</think>\\boxed{5}", "4", "<think>x"]
    refs = ["4", "4", "4", "4"]
    modes = ["think", "think", "no_think", "think"]
    batch = score_batch(responses, refs, tasks="numeric", modes=modes, spec=SPEC, num_tokens=[10, 10, 3000, 2816])
    single = [score(r, ref, "numeric", m, SPEC, num_tokens=n)
              for r, ref, m, n in zip(responses, refs, modes, [10, 10, 3000, 2816])]
    assert [b.as_dict() for b in batch] == [s.as_dict() for s in single]
    # Hand-computed: format / accuracy / overlong per sample.
    assert [b.parts["format"] for b in batch] == [1.0, 1.0, 1.0, 0.0]
    assert [b.parts["accuracy"] for b in batch] == [1.0, 0.0, 1.0, 0.0]
    assert [b.parts["overlong"] for b in batch] == [0.0, 0.0, -0.859375, -0.5]  # -(3000-2560)/512


def test_shared_extras_are_broadcast() -> None:
    batch = score_batch(["B", "(C)"], ["B", "B"], tasks="mc", choices=[["x", "y", "z"], ["x", "y", "z"]],
                        spec=RewardSpec(format=0.0, accuracy=1.0, json=1.0), instructions={"markdown": "list"})
    assert [r.parts for r in batch] == [{"accuracy": 1.0}, {"accuracy": 0.0}]  # json does not apply


def test_wrong_lengths_raise_with_the_index() -> None:
    with pytest.raises(KeyeInputError, match="2 entries for 3"):
        score_batch(["a", "b", "c"], ["1", "2"])
    with pytest.raises(KeyeInputError, match="num_tokens has 1 entries"):
        score_batch(["a", "b"], None, num_tokens=[1])
    with pytest.raises(KeyeInputError) as err:
        score_batch(["a", "b"], ["1", "2"], tasks=["numeric", "bogus"])
    assert err.value.item == 1


def test_empty_batch() -> None:
    assert score_batch([], []) == []
    assert aggregate_stats([]) == {"reward/count": 0.0}


def test_aggregate_stats_by_hand() -> None:
    results = [
        RewardResult(total=2.0, parts={"format": 1.0, "accuracy": 1.0}),
        RewardResult(total=0.0, parts={"format": 0.0, "accuracy": 0.0}),
        RewardResult(total=1.0, parts={"format": 1.0}),
    ]
    stats = aggregate_stats(results)
    assert stats["reward/count"] == 3.0
    assert stats["reward/total/mean"] == pytest.approx(1.0)
    assert stats["reward/total/std"] == pytest.approx((2 / 3) ** 0.5)  # population std of 2, 0, 1
    assert stats["reward/format/mean"] == pytest.approx(2 / 3)
    assert stats["reward/accuracy/mean"] == pytest.approx(0.5)  # over the 2 samples where it applied
    assert stats["reward/accuracy/frac"] == pytest.approx(2 / 3)
    assert stats["reward/accuracy/min"] == 0.0 and stats["reward/accuracy/max"] == 1.0
    assert stats["reward/math_timeouts"] == 0.0
    assert set(aggregate_stats(results, prefix="r.")) >= {"r.count", "r.format/mean"}


def test_rlep_group_reward_shape() -> None:
    # RLEP scores replayed and fresh responses with the same function: verifier ±1 plus the overlong penalty;
    # an empty pad response (pool smaller than M) is scored as incorrect (training.md §1.3 steps 4, 6, 10).
    spec = RewardSpec.from_dict({"rewards": ["accuracy", "overlong"], "options": {"accuracy_pm1": True}})
    group = ["\\boxed{7}", "\\boxed{8}", ""]
    results = score_batch(group, ["7"] * 3, tasks="math", spec=spec, num_tokens=[100, 2816, 1])
    assert [r.total for r in results] == [1.0, -1.5, -1.0]
