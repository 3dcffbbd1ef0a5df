"""RewardScorer: the reward module's totals, pass flags from the accuracy part, invalid rows."""

from __future__ import annotations

import torch

from keye.rewards import RewardSpec
from keye.rl.rollout.samples import PromptInputs, RLPrompt, RolloutSample
from keye.rl.rollout.scoring import RewardScorer


def _sample(prompt, text, valid=True):
    return RolloutSample(prompt, 0, PromptInputs(torch.tensor([1])), torch.tensor([1, 2]), text, True, valid=valid)


def test_reward_scorer_parts_and_pass_flags():
    p = RLPrompt("q", [], reference="5", task="numeric", mode="think")
    samples = [
        _sample(p, "<think>2+3=5</think>The answer is 5"),  # format 1 + accuracy 1
        _sample(p, "The answer is 5"),                      # no think block: format 0, still correct
        _sample(p, "<think>hmm</think>6"),                  # well formed, wrong
        _sample(p, "", valid=False),                        # a missing replay slot
    ]
    scores = RewardScorer()(samples)
    assert scores.rewards == [2.0, 1.0, 1.0, 0.0]
    assert scores.passed == [True, True, False, False]
    assert scores.parts[0] == {"format": 1.0, "accuracy": 1.0} and scores.parts[3] == {}
    pm1 = RewardScorer(RewardSpec(accuracy=1.0, format=0.0, accuracy_pm1=True))(samples[:3])
    assert pm1.rewards == [1.0, 1.0, -1.0] and pm1.passed == [True, True, False]
