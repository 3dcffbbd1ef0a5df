"""Dynamic sampling refill, prompt filtering, mode mix and group-preserving mini-batches."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.processing.chat import apply_mode
from keye.rl.algorithms.sampling import (
    ModeMix,
    dynamic_sample,
    filter_prompts,
    group_minibatches,
    group_signal,
    is_informative,
)
from keye.rl.rollout.samples import PromptInputs, RLPrompt, RolloutSample
from keye.rl.rollout.scoring import Scores


@dataclass
class _Group:
    prompt: int
    rewards: list[float]


class _Source:
    """Prompts 0, 1, 2, ... up to ``limit``; records each draw size."""

    def __init__(self, limit=100):
        self.next = 0
        self.limit = limit
        self.draws = []

    def __call__(self, k):
        self.draws.append(k)
        got = list(range(self.next, min(self.next + k, self.limit)))
        self.next += len(got)
        return got


def _produce(prompts):
    # prompt p is informative iff p % 3 == 0: rewards [0, 1]; otherwise all equal
    return [_Group(p, [0.0, 1.0] if p % 3 == 0 else [1.0, 1.0]) for p in prompts]


def test_is_informative():
    assert is_informative([0, 1]) and not is_informative([1, 1, 1]) and not is_informative([1])
    assert not is_informative([0.0, 1e-9], atol=1e-6)


def test_refill_until_full():
    # round 1 draws 0..2 (informative: 0); round 2 draws 3, 4 (3); round 3 draws 5 (none); round 4 draws 6
    src = _Source()
    res = dynamic_sample(src, _produce, 3, max_rounds=8)
    assert [g.prompt for g in res.groups] == [0, 3, 6]
    assert src.draws == [3, 2, 1, 1]
    assert res.full and not res.exhausted
    assert (res.rounds, res.generated, res.dropped, res.surplus) == (4, 7, 4, 0)


def test_refill_draw_sizes_and_surplus():
    src = _Source()
    res = dynamic_sample(src, _produce, 4, oversample=2.0)
    # round 1: 8 prompts 0..7 -> informative 0, 3, 6; round 2: ceil(1 * 2) = 2 prompts 8, 9 -> 9
    assert src.draws == [8, 2]
    assert [g.prompt for g in res.groups] == [0, 3, 6, 9]
    assert (res.rounds, res.generated, res.dropped, res.surplus) == (2, 10, 6, 0)
    stats = res.stats()
    assert stats["dynsample/kept_frac"] == pytest.approx(0.4)
    res2 = dynamic_sample(_Source(), _produce, 1, oversample=3.0)  # 0..2 -> 0 kept, nothing surplus
    assert [g.prompt for g in res2.groups] == [0] and res2.surplus == 0
    res3 = dynamic_sample(_Source(), _produce, 1, oversample=4.0)  # 0..3 -> 0 kept, prompt 3 is surplus
    assert res3.surplus == 1


def test_round_limit_and_exhaustion():
    res = dynamic_sample(_Source(), _produce, 5, max_rounds=2)
    assert not res.full and res.rounds == 2 and len(res.groups) < 5
    with pytest.raises(KeyeInputError, match="filled"):
        dynamic_sample(_Source(), _produce, 5, max_rounds=2, strict=True)
    res = dynamic_sample(_Source(limit=5), _produce, 5)
    assert res.exhausted and [g.prompt for g in res.groups] == [0, 3]
    with pytest.raises(KeyeInputError):
        dynamic_sample(_Source(), lambda ps: _produce(ps)[:-1], 2)
    with pytest.raises(KeyeConfigError):
        dynamic_sample(_Source(), _produce, 0)


def _scored_group(prompt_id, rewards, passed, valid=None):
    valid = valid or [True] * len(rewards)
    return [RolloutSample(RLPrompt(prompt_id, []), 0, PromptInputs(torch.tensor([1])), torch.tensor([1]), "", True,
                          valid=v, reward=r if v else None, passed=ok if v else None)
            for r, ok, v in zip(rewards, passed, valid)]


def test_group_signal_and_dynamic_sample_by_metric():
    """The helpers under dynamic sampling; the recipe's default is driven for real in
    tests/train/test_rlep.py::test_dynamic_sampling_drops_groups_on_accuracy_by_default."""
    # "wrong": every answer wrong, format rewards differ (total reward 0 / 0.5 / 1 from the format part);
    # "mixed": one right answer; "right": all right, one badly formatted; "replayed": all fresh answers wrong
    # plus a replayed success and a missing replay slot
    groups = {
        "wrong": _scored_group("wrong", [0.0, 0.5, 1.0], [False, False, False]),
        "mixed": _scored_group("mixed", [1.0, 1.0, 2.0], [False, False, True]),
        "right": _scored_group("right", [2.0, 1.5, 2.0], [True, True, True]),
        "replayed": _scored_group("replayed", [0.0, 0.0, 2.0, 0.0], [False, False, True, False],
                                  valid=[True, True, True, False]),
    }
    order = list(groups)

    def run(metric):
        src = iter(order)
        res = dynamic_sample(lambda k: [next(src) for _ in range(min(k, len(order)))], lambda ps: [groups[p] for p in ps],
                             4, rewards_of=lambda g: group_signal(g, metric), max_rounds=1)
        return [g[0].prompt.id for g in res.groups]

    assert run("accuracy") == ["mixed", "replayed"]  # DAPO: all-wrong and all-right groups carry no signal
    assert run("reward") == ["wrong", "mixed", "right", "replayed"]
    assert group_signal(groups["replayed"], "accuracy") == [0.0, 0.0, 1.0]  # the missing slot is skipped
    with pytest.raises(KeyeConfigError, match="metric"):
        group_signal(groups["wrong"], "format")
    with pytest.raises(KeyeInputError, match="passed"):
        group_signal(_scored_group("x", [0.0], [None]), "accuracy")


class _FixedPassEngine:
    """Prompt id 'p<k>' passes on its first k of n samples."""

    def generate(self, prompts, n):
        return [RolloutSample(p, i, PromptInputs(torch.tensor([1])), torch.tensor([1]), str(j < int(p.id[1:])), True)
                for i, p in enumerate(prompts) for j in range(n)]


def test_filter_prompts_keeps_strictly_mixed_accuracy():
    prompts = [RLPrompt(f"p{k}", []) for k in (0, 1, 3, 4, 2)]
    res = filter_prompts(prompts, _FixedPassEngine(), lambda ss: Scores([0.0] * len(ss), [s.text == "True" for s in ss]),
                         4, batch_prompts=2)
    assert [p.id for p in res.kept] == ["p1", "p3", "p2"]
    assert res.pass_rates == {"p0": 0.0, "p1": 0.25, "p3": 0.75, "p4": 1.0, "p2": 0.5}
    with pytest.raises(KeyeConfigError):
        filter_prompts(prompts, _FixedPassEngine(), None, 4, low=0.5, high=0.5)


def test_mode_mix_counts_and_assignment():
    mix = ModeMix.from_config({"think": 0.5, "no_think": 0.3, "auto": 0.2})
    assert mix.counts(10) == {"think": 5, "no_think": 3, "auto": 2}
    # n = 7: raw 3.5, 2.1, 1.4 -> floors 3, 2, 1 (6), the largest remainder (think, .5) gets the last one
    assert mix.counts(7) == {"think": 4, "no_think": 2, "auto": 1}
    assert ModeMix().counts(3) == {"think": 1, "no_think": 1, "auto": 1}
    prompts = [RLPrompt(str(i), [{"role": "user", "content": "hi"}]) for i in range(10)]
    a = mix.assign(prompts, random.Random(1))
    b = mix.assign(prompts, random.Random(1))
    assert [p.mode for p in a] == [p.mode for p in b]
    assert sorted(p.mode for p in a) == sorted(["think"] * 5 + ["no_think"] * 3 + ["auto"] * 2)
    assert all(p.mode is None for p in prompts)  # originals untouched
    texts = {p.mode: apply_mode(p.messages, p.mode)[-1]["content"] for p in a}
    assert texts == {"think": "hi/think", "no_think": "hi/no_think", "auto": "hi"}
    with pytest.raises(KeyeConfigError):
        ModeMix.from_config({"agentic": 1.0})
    with pytest.raises(KeyeConfigError):
        ModeMix(0, 0, 0)


def test_group_minibatches_keep_groups_whole():
    groups = torch.tensor([3, 0, 3, 1, 0, 2, 1, 2, 3])
    mbs = group_minibatches(groups, 2, generator=torch.Generator().manual_seed(0))
    assert len(mbs) == 2
    seen = torch.cat(mbs).sort().values
    assert torch.equal(seen, torch.arange(9))
    for idx in mbs:
        ids = set(groups[idx].tolist())
        assert len(ids) == 2
        for g in ids:  # every member of a chosen group is in this mini-batch
            assert set(torch.nonzero(groups == g).squeeze(1).tolist()) <= set(idx.tolist())
