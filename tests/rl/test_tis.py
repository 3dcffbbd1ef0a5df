"""Truncated importance sampling (rollout-engine / learner mismatch correction) in :func:`policy_loss`:
off changes nothing, weights are ``min(exp(old - rollout), cap)`` without gradient, the gradient is the
hand-computed reweighted one, replayed rows (or a batch without engine log-probs) keep weight 1, KL / entropy are
not reweighted, stats."""

from __future__ import annotations

import math

import pytest
import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.algorithms.losses import policy_loss


def _batch(seed: int = 0, b: int = 3, t: int = 5):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = (old + 0.3 * torch.randn(b, t, generator=g, dtype=torch.float64)).requires_grad_(True)
    rollout = old + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[1, 3:] = 0  # a shorter row
    return logp, old, rollout, adv, mask


def _loss_and_grad(logp, *args, **kw):
    x = logp.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(x, *args, **kw)
    loss.backward()
    return loss.detach(), x.grad, stats


def test_off_is_bit_identical_and_a_matching_engine_changes_nothing():
    logp, old, rollout, adv, mask = _batch()
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0)
    base_loss, base_grad, base_stats = _loss_and_grad(logp, old, adv, mask, **kw)
    # rollout log-probs passed without a cap: nothing happens
    loss, grad, stats = _loss_and_grad(logp, old, adv, mask, rollout_logp=rollout, **kw)
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad) and stats == base_stats
    # an engine that reports exactly the learner's log-probs: every weight is exp(0) = 1
    loss, grad, stats = _loss_and_grad(logp, old, adv, mask, rollout_logp=old.clone(), tis_cap=2.0, **kw)
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
    assert stats["tis_weight_mean"] == 1.0 and stats["tis_clip_frac"] == 0.0 and stats["rollout_logp_abs_diff"] == 0.0
    assert "tis_weight_mean" not in base_stats


def test_weights_clamp_at_the_cap_and_the_gradient_is_reweighted_by_hand():
    # one token per row, every ratio inside the clip range, so d loss / d logp_i = -A_i * ratio_i * w_i / n
    n = 4
    log_ratio = torch.tensor([0.05, -0.1, 0.0, 0.12], dtype=torch.float64)
    old = torch.tensor([[-1.0], [-2.0], [-0.5], [-3.0]], dtype=torch.float64)
    logp = (old[:, 0] + log_ratio)[:, None].requires_grad_(True)
    engine_ratio = torch.tensor([0.5, 1.5, 3.0, 100.0], dtype=torch.float64)  # pi_old / pi_rollout
    rollout = old - engine_ratio.log()[:, None]
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    mask = torch.ones(n, 1, dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, rollout_logp=rollout, tis_cap=2.0)
    loss.backward()
    w = torch.tensor([0.5, 1.5, 2.0, 2.0], dtype=torch.float64)
    ratio = log_ratio.exp()
    torch.testing.assert_close(loss, (-adv * ratio * w).sum() / n, rtol=1e-12, atol=0)
    torch.testing.assert_close(logp.grad[:, 0], -adv * ratio * w / n, rtol=1e-12, atol=0)
    assert stats["tis_weight_mean"] == pytest.approx(w.mean().item(), rel=1e-12)
    assert stats["tis_clip_frac"] == pytest.approx(0.5)
    assert stats["rollout_logp_abs_diff"] == pytest.approx(engine_ratio.log().abs().mean().item(), rel=1e-12)


def test_clipped_tokens_stay_without_gradient_and_the_weight_carries_none():
    # ratio 1.5 with A > 0 is clipped at 1 + eps_high: value -A * 1.28 * w, zero gradient whatever w is
    old = torch.zeros(1, 1, dtype=torch.float64)
    logp = torch.full((1, 1), math.log(1.5), dtype=torch.float64, requires_grad=True)
    rollout = torch.full((1, 1), -math.log(1.7), dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, old, torch.ones(1, dtype=torch.float64), torch.ones_like(old), rollout_logp=rollout,
                          tis_cap=4.0)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-1.28 * 1.7, dtype=torch.float64))
    assert logp.grad.item() == 0.0 and rollout.grad is None


def test_replayed_rows_keep_weight_one():
    logp, old, rollout, adv, mask = _batch(seed=1)
    has = torch.tensor([True, False, True])
    zeros_for_replay = rollout.clone()
    zeros_for_replay[1] = 0.0  # what collate_samples writes for a replayed row
    loss, grad, stats = _loss_and_grad(logp, old, adv, mask, rollout_logp=zeros_for_replay, tis_cap=2.0,
                                       has_rollout_logp=has)
    # the same as giving the replayed row its own old log-probs (weight exactly 1)
    same = rollout.clone()
    same[1] = old[1]
    ref_loss, ref_grad, _ = _loss_and_grad(logp, old, adv, mask, rollout_logp=same, tis_cap=2.0)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    # in the stats the replayed row's tokens count with weight 1, unclipped, no difference
    w = (old - same).exp()
    sel = mask.bool()
    assert stats["tis_weight_mean"] == pytest.approx(w.clamp(max=2.0)[sel].mean().item(), rel=1e-12)
    assert stats["tis_clip_frac"] == pytest.approx((w[sel] > 2.0).double().mean().item(), rel=1e-12)
    assert stats["rollout_logp_abs_diff"] == pytest.approx((old - same).abs()[sel].mean().item(), rel=1e-12)
    assert 0 < stats["tis_clip_frac"] < 1

    # a micro-batch where no row has engine log-probs (all replayed): weight 1 everywhere, the loss unchanged
    base_loss, base_grad, _ = _loss_and_grad(logp, old, adv, mask)
    loss, grad, stats = _loss_and_grad(logp, old, adv, mask, rollout_logp=None, tis_cap=2.0)
    assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
    assert (stats["tis_weight_mean"], stats["tis_clip_frac"], stats["rollout_logp_abs_diff"]) == (1.0, 0.0, 0.0)


def test_kl_and_entropy_terms_are_not_reweighted():
    logp, old, rollout, _, mask = _batch(seed=2)
    zero_adv = torch.zeros(3, dtype=torch.float64)
    ref = old - 0.2
    ent = torch.rand(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    kw = dict(ref_logp=ref, kl_coef=0.3, entropy=ent, entropy_coef=0.01)
    base, base_grad, _ = _loss_and_grad(logp, old, zero_adv, mask, **kw)
    with_tis, grad, stats = _loss_and_grad(logp, old, zero_adv, mask, rollout_logp=rollout, tis_cap=1.5, **kw)
    assert torch.equal(with_tis, base) and torch.equal(grad, base_grad)
    assert stats["tis_clip_frac"] > 0  # the weights were not all 1: the KL term simply does not see them


def test_bad_tis_arguments_are_refused():
    logp, old, rollout, adv, mask = _batch()
    with pytest.raises(KeyeConfigError, match="tis_cap"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=0.5)
    with pytest.raises(KeyeInputError, match="rollout_logp has shape"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout[:, :2], tis_cap=2.0)
    with pytest.raises(KeyeInputError, match="has_rollout_logp"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout, tis_cap=2.0,
                    has_rollout_logp=torch.ones(2, dtype=torch.bool))
