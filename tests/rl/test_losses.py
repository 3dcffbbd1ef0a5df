"""Policy loss: clip-higher, dual clip, GSPO ratio, KL estimators, aggregation and micro-batching."""

from __future__ import annotations

import math

import pytest
import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.algorithms.losses import aggregate, kl_penalty, policy_loss


def _one_token_rows(log_ratios, advantages):
    old = torch.zeros(len(log_ratios), 1, dtype=torch.float64)
    logp = torch.tensor(log_ratios, dtype=torch.float64)[:, None].requires_grad_(True)
    return logp, old, torch.tensor(advantages, dtype=torch.float64), torch.ones_like(old)


def test_clip_higher_and_dual_clip_by_hand():
    # four tokens, eps_low 0.2, eps_high 0.28, c = 10:
    #  A=+1, ratio 1.5 -> clipped at 1.28:           L = -1.28, no gradient
    #  A=-1, ratio 0.5 -> clipped at 0.8:            L = 0.8,   no gradient
    #  A=-1, ratio 20  -> max(20, 1.28) = 20, dual:  L = 10,    no gradient
    #  A=+1, ratio 1.1 -> inside the range:          L = -1.1,  dL/dlogp = -1.1
    logp, old, adv, mask = _one_token_rows([math.log(1.5), math.log(0.5), math.log(20.0), math.log(1.1)],
                                           [1.0, -1.0, -1.0, 1.0])
    loss, stats = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, dual_clip=10.0)
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.8 + 10.0 - 1.1) / 4, dtype=torch.float64))
    loss.backward()
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([0.0, 0.0, 0.0, -1.1 / 4], dtype=torch.float64))
    assert stats["clip_frac_high"] == pytest.approx(0.25)
    assert stats["clip_frac_low"] == pytest.approx(0.25)
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["dual_clip_frac"] == pytest.approx(0.25)
    assert stats["num_tokens"] == 4
    assert stats["ratio_max"] == pytest.approx(20.0)

    # without the dual clip the third token costs 20 and keeps its gradient (-A * ratio = 20 per unit logp)
    logp2, old2, adv2, mask2 = _one_token_rows([math.log(20.0)], [-1.0])
    loss2, stats2 = policy_loss(logp2, old2, adv2, mask2)
    loss2.backward()
    torch.testing.assert_close(loss2, torch.tensor(20.0, dtype=torch.float64))
    torch.testing.assert_close(logp2.grad, torch.tensor([[20.0]], dtype=torch.float64))
    assert stats2["dual_clip_frac"] == 0.0


def test_clip_higher_is_asymmetric():
    # ratio 1.25 with A > 0: clipped under symmetric 0.2, not under clip-higher 0.28
    logp, old, adv, mask = _one_token_rows([math.log(1.25)], [1.0])
    _, sym = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    _, hi = policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert sym["clip_frac_high"] == 1.0 and hi["clip_frac_high"] == 0.0


def test_gspo_sequence_ratio_value_and_gradient():
    # one sequence, two tokens with log-ratios 0.02 and 0.4: s = exp(0.21).
    old = torch.zeros(1, 2, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    adv = torch.tensor([1.0], dtype=torch.float64)
    s = math.exp(0.21)
    # wide clip: loss = -A * s, gradient per token = -A * s / 2 (seq-mean-token-mean over 2 tokens)
    logp = torch.tensor([[0.02, 0.4]], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(logp, old, adv, mask, eps_low=0.5, eps_high=0.5, ratio_level="sequence",
                              loss_agg="seq-mean-token-mean")
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-s, dtype=torch.float64))
    torch.testing.assert_close(logp.grad, torch.full((1, 2), -s / 2, dtype=torch.float64))
    assert stats["ratio_mean"] == pytest.approx(s)
    # eps_high 0.1: the sequence ratio 1.234 is clipped, so both tokens are (token level clips only one)
    logp = torch.tensor([[0.02, 0.4]], dtype=torch.float64, requires_grad=True)
    _, seq_stats = policy_loss(logp, old, adv, mask, eps_high=0.1, ratio_level="sequence")
    _, tok_stats = policy_loss(logp, old, adv, mask, eps_high=0.1, ratio_level="token")
    assert seq_stats["clip_frac_high"] == 1.0 and tok_stats["clip_frac_high"] == 0.5


def test_gspo_ignores_masked_tokens():
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[0.1, 0.3, 5.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    loss, _ = policy_loss(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, eps_low=1.0, eps_high=1.0,
                          ratio_level="sequence", loss_agg="seq-mean-token-mean")
    torch.testing.assert_close(loss, torch.tensor(-math.exp(0.2), dtype=torch.float64))


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([1.0]))
    # k3 with log r = ref - logp = -1: e^-1 + 1 - 1
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([math.exp(-1.0)]))
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), torch.tensor([math.exp(-1.0)]))
    # k2 = (logp - ref)^2 / 2
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5]))
    with pytest.raises(KeyeConfigError):
        kl_penalty(logp, ref, "k4")
    # added to the loss with its coefficient
    lp = torch.tensor([[-1.0]], dtype=torch.float64)
    base, _ = policy_loss(lp, lp.clone(), torch.tensor([0.0], dtype=torch.float64), torch.ones_like(lp))
    with_kl, st = policy_loss(lp, lp.clone(), torch.tensor([0.0], dtype=torch.float64), torch.ones_like(lp),
                              ref_logp=lp - 1.0, kl_coef=0.5, kl_estimator="k2")
    torch.testing.assert_close(with_kl - base, torch.tensor(0.25, dtype=torch.float64))
    assert st["kl"] == pytest.approx(0.5)
    with pytest.raises(KeyeInputError):
        policy_loss(lp, lp, torch.tensor([0.0], dtype=torch.float64), torch.ones_like(lp), kl_coef=0.1)


def test_aggregation_modes_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the empty third row counts nowhere
    assert float(aggregate(values, mask, "token-mean")) == pytest.approx(7 / 3)
    assert float(aggregate(values, mask, "seq-mean-token-mean")) == pytest.approx((1.5 + 4.0) / 2)
    assert float(aggregate(values, mask, "seq-mean-token-sum")) == pytest.approx((3 + 4) / 2)
    assert float(aggregate(values, mask, "seq-mean-token-sum-norm", loss_scale_factor=5)) == pytest.approx(7 / (5 * 2))
    assert float(aggregate(values, mask, "token-mean", global_token_count=14)) == pytest.approx(0.5)
    with pytest.raises(KeyeConfigError):
        aggregate(values, mask, "sum")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_micro_batch_accumulation_equals_full_batch(mode, ratio_level):
    gen = torch.Generator().manual_seed(0)
    b, t = 7, 9
    base = torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3 - 2.0
    old = base + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.2
    lengths = torch.tensor([9, 1, 5, 0, 7, 3, 8])  # uneven, one empty row
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    kw = dict(dual_clip=3.0, ratio_level=ratio_level, loss_agg=mode, loss_scale_factor=float(t))

    full_p = base.clone().requires_grad_(True)
    full, _ = policy_loss(full_p, old, adv, mask, **kw)
    full.backward()

    n_tok = mask.sum()
    n_seq = (mask.sum(-1) > 0).sum()
    acc_p = base.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    naive = torch.zeros((), dtype=torch.float64)
    splits = [slice(0, 2), slice(2, 3), slice(3, 7)]
    for sl in splits:
        part, _ = policy_loss(acc_p[sl], old[sl], adv[sl], mask[sl], global_token_count=n_tok,
                              global_seq_count=n_seq, **kw)
        part.backward()
        total = total + part.detach()
        local, _ = policy_loss(base[sl], old[sl], adv[sl], mask[sl], **kw)
        naive = naive + local / len(splits)  # the usual "mean of micro-batch means"
    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(acc_p.grad, full_p.grad)
    assert not torch.isclose(naive, full.detach())


def test_shape_and_config_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(KeyeConfigError):
        policy_loss(x, x, torch.zeros(2), x, dual_clip=1.0)
    with pytest.raises(KeyeConfigError):
        policy_loss(x, x, torch.zeros(2), x, ratio_level="seq")
    with pytest.raises(KeyeInputError):
        policy_loss(x, x, torch.zeros(3), x)
    with pytest.raises(KeyeInputError):
        policy_loss(x, torch.zeros(2, 4), torch.zeros(2), x)
