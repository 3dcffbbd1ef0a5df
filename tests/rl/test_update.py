"""Glue: advantages on samples, replay assembly, old log-probs, micro-batch-invariant gradients on a model."""

from __future__ import annotations

import pytest
import torch

from keye.errors import KeyeInputError
from keye.rl.algorithms.replay import ReplayEntry, ReplayPool, add_replay
from keye.rl.algorithms.update import accumulate_policy_gradients, assign_advantages, fill_logprobs
from keye.rl.rollout.samples import PromptInputs, RLPrompt, RolloutSample
from tests.rl.helpers import rl_samples

EPS = 1e-6


def _s(prompt, group, reward, source="rollout", valid=True, passed=None):
    return RolloutSample(prompt, group, PromptInputs(torch.tensor([1])), torch.tensor([5, 6]), "t", True,
                         source=source, valid=valid, reward=reward, passed=passed)


def test_assign_advantages_with_replay_and_missing_slot():
    p, q = RLPrompt("p", []), RLPrompt("q", [])
    # group 0: fresh -1 x3, replay +1 and a missing slot -> -0.5, 1.5, 0 over (1 + eps) (see test_advantages)
    # group 1: fresh [1, 0] -> unbiased std sqrt(0.5)
    samples = [_s(p, 0, -1.0), _s(p, 0, -1.0), _s(q, 1, 1.0), _s(p, 0, -1.0), _s(p, 0, 1.0, "replay"),
               _s(p, 0, None, "replay", valid=False), _s(q, 1, 0.0)]
    adv = assign_advantages(samples, eps=EPS)
    a = 0.5 / (2**-0.5 + EPS)
    expect = torch.tensor([-0.5 / (1 + EPS)] * 2 + [a, -0.5 / (1 + EPS), 1.5 / (1 + EPS), 0.0, -a])
    torch.testing.assert_close(adv, expect)
    assert [s.advantage for s in samples] == pytest.approx(expect.tolist())
    with pytest.raises(KeyeInputError):
        assign_advantages([_s(p, 0, None)])


def test_assign_advantages_difficulty_counts_fresh_only():
    p = RLPrompt("p", [])
    # fresh passed [T, F, F, F] -> rate 0.25 -> x1.25 under "mixed_up"; the replay success does not count
    samples = [_s(p, 0, r, passed=r > 0) for r in (1.0, 0.0, 0.0, 0.0)] + [_s(p, 0, 1.0, "replay", passed=True)]
    plain = assign_advantages(samples).clone()
    shaped = assign_advantages(samples, difficulty="mixed_up")
    torch.testing.assert_close(shaped, plain * 1.25)


def test_k1_kl_as_a_reward_penalty():
    """verl's KL-in-reward: each response's reward minus coef * sum_t (old_logp - ref_logp) (k1) before the
    group normalisation; the task reward on the sample is left as scored."""
    p = RLPrompt("p", [])
    samples = [_s(p, 0, r) for r in (1.0, 0.0, 1.0)] + [_s(p, 0, None, "replay", valid=False)]
    for s, (old, ref) in zip(samples, [([-1.0, -2.0], [-1.5, -2.5]), ([-0.5, -0.1], [-0.5, -0.1]),
                                       ([-3.0, -1.0], [-1.0, -1.0])]):
        s.old_logp, s.ref_logp = torch.tensor(old), torch.tensor(ref)
    adv = assign_advantages(samples, kl_reward_coef=0.5)
    # k1 sums 1.0, 0.0, -2.0 -> shaped rewards 0.5, 0.0, 2.0: mean 5/6, unbiased std sqrt(13/12)
    shaped = torch.tensor([0.5, 0.0, 2.0], dtype=torch.float64)
    expect = (shaped - shaped.mean()) / (shaped.std() + 1e-6)
    torch.testing.assert_close(adv[:3], expect.float())
    assert float(adv[3]) == 0.0
    assert [s.reward for s in samples[:3]] == [1.0, 0.0, 1.0]
    assert samples[0].metadata["kl_reward_penalty"] == pytest.approx(0.5)
    samples[1].ref_logp = None
    with pytest.raises(KeyeInputError, match="ref_logp"):
        assign_advantages(samples, kl_reward_coef=0.5)


def test_add_replay_orders_groups_and_pads_missing_slots():
    pool = ReplayPool()
    pool.add(ReplayEntry("a", "x", [7, 9]))
    fresh = [_s(RLPrompt("a", []), 0, 0.0), _s(RLPrompt("b", []), 1, 0.0), _s(RLPrompt("a", []), 0, 0.0)]
    out = add_replay(fresh, pool, 2, encode=lambda t: [1], eos_id=9, max_response_len=8)
    assert [(s.group, s.source, s.valid) for s in out] == [
        (0, "rollout", True), (0, "rollout", True), (0, "replay", True), (0, "replay", False),
        (1, "rollout", True), (1, "replay", False), (1, "replay", False)]
    assert out[2].inputs is fresh[0].inputs


def test_first_update_has_unit_ratio_including_replay(tiny_model, rl_processor):
    samples = rl_samples(tiny_model, rl_processor)
    assert sum(s.source == "replay" and s.valid for s in samples) == 1
    tiny_model.train()
    stats = accumulate_policy_gradients(tiny_model, samples, pad_id=rl_processor.pad_token_id, micro_batch_size=4)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-4) and stats["clip_frac"] == 0.0
    assert stats["tokens"] == sum(s.num_tokens for s in samples) and stats["sequences"] == 7


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_gradients_do_not_depend_on_micro_batching(tiny_model, rl_processor, loss_agg):
    samples = rl_samples(tiny_model, rl_processor)
    gen = torch.Generator().manual_seed(1)
    for s in samples:  # move the behaviour policy away so clipping and dual clip are exercised
        if s.old_logp is not None:
            s.old_logp = s.old_logp + torch.randn(s.old_logp.shape, generator=gen) * 0.4
    tiny_model.train()
    grads, all_stats = [], []
    for micro in (1, 3, 100):
        tiny_model.zero_grad()
        all_stats.append(accumulate_policy_gradients(
            tiny_model, samples, pad_id=rl_processor.pad_token_id, micro_batch_size=micro,
            loss_kwargs=dict(dual_clip=1.5, loss_agg=loss_agg)))
        grads.append(torch.cat([p.grad.flatten() for p in tiny_model.parameters() if p.grad is not None]))
    assert all_stats[0]["clip_frac"] > 0
    for g, st in zip(grads[1:], all_stats[1:]):
        torch.testing.assert_close(g, grads[0], atol=1e-5, rtol=1e-4)
        assert st["loss"] == pytest.approx(all_stats[0]["loss"], abs=1e-5)
        assert st["clip_frac"] == pytest.approx(all_stats[0]["clip_frac"])


def test_a_descent_step_moves_log_probs_in_the_advantage_direction(tiny_model, rl_processor):
    samples = rl_samples(tiny_model, rl_processor)
    live = [s for s in samples if s.valid]
    for i, s in enumerate(live):
        s.advantage = 1.0 if i % 2 == 0 else -1.0
    pad = rl_processor.pad_token_id
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.05)
    tiny_model.train()
    accumulate_policy_gradients(tiny_model, live, pad_id=pad, micro_batch_size=4)
    opt.step()
    before = [s.old_logp.sum() for s in live]
    fill_logprobs(tiny_model, live, pad_id=pad, micro_batch_size=4)
    moved = [float(s.old_logp.sum() - b) for s, b in zip(live, before)]
    # first order: the step raises sum(A * logp); in this seeded case every sample moves its own way
    assert sum(moved[0::2]) - sum(moved[1::2]) > 0
    assert all(d > 0 for d in moved[0::2]) and all(d < 0 for d in moved[1::2]), moved
