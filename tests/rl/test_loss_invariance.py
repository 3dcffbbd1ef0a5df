"""RL losses at scale (issue 17): results that must not depend on padding, micro-batching or chunking,
and loss settings whose gradients are right.

Expected values are computed independently: the full-vocabulary log-softmax by autograd for the chunked
log-probs, the exact KL of a small categorical distribution (summed over its support) for the KL
estimators, and the unpadded single-batch loss for the Dr.GRPO normalisation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl import accumulate_policy_gradients
from keye.rl.algorithms.losses import aggregate, kl_penalty, policy_loss
from keye.rl.config import RLEPConfig, policy_loss_kwargs, validate
from keye.testing.model import make_tiny_model
from keye.train.config import load_config
from keye.train.logprobs import chunked_token_logprobs
from keye.train.tree import build_tree, sequence_logprobs, tree_logprobs
from tests.rl.helpers import rl_samples


# ------------------------------------------------------------------ item 2: Dr.GRPO constant normaliser
def test_dr_grpo_aggregation_needs_a_constant_factor():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # without a factor the old code divided by the padded width (3 here, 8 after padding)
    with pytest.raises(KeyeConfigError, match="loss_scale_factor"):
        aggregate(values, mask, "seq-mean-token-sum-norm")
    padded, pmask = F.pad(values, (0, 5), value=7.0), F.pad(mask, (0, 5))
    a = aggregate(values, mask, "seq-mean-token-sum-norm", loss_scale_factor=16)
    b = aggregate(padded, pmask, "seq-mean-token-sum-norm", loss_scale_factor=16)
    assert float(a) == float(b) == pytest.approx((1 + 2 + 4) / (16 * 2))


def test_dr_grpo_config_default_is_the_max_response_length():
    over = ["algorithm.loss_agg=seq-mean-token-sum-norm", "rollout.max_new_tokens=48"]
    assert policy_loss_kwargs(load_config(RLEPConfig, None, over))["loss_scale_factor"] == 48.0
    cfg = load_config(RLEPConfig, None, [*over, "algorithm.loss_scale_factor=100"])
    assert policy_loss_kwargs(cfg)["loss_scale_factor"] == 100.0
    with pytest.raises(KeyeConfigError, match="algorithm.loss_scale_factor"):
        validate(load_config(RLEPConfig, None, [*over, "algorithm.loss_scale_factor=0"]))


def test_dr_grpo_loss_is_invariant_to_padding_and_split():
    gen = torch.Generator().manual_seed(0)
    b, t = 6, 7
    lengths = torch.tensor([7, 2, 5, 1, 6, 3])
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    base = torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3 - 2.0
    old = base + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.2
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    cfg = load_config(RLEPConfig, None, ["algorithm.loss_agg=seq-mean-token-sum-norm", "rollout.max_new_tokens=32",
                                         "algorithm.dual_clip=3.0"])
    kw = policy_loss_kwargs(cfg)

    full_p = base.clone().requires_grad_(True)
    full, _ = policy_loss(full_p, old, adv, mask, **kw)
    full.backward()
    # the same rows padded to 12 columns (garbage in the padding), then cut into micro-batches that are
    # each trimmed to their own longest row, with the global sequence count
    pad = 5
    p_base, p_old, p_mask = F.pad(base, (0, pad), value=3.0), F.pad(old, (0, pad), value=-1.0), F.pad(mask, (0, pad))
    pad_p = p_base.clone().requires_grad_(True)
    padded, _ = policy_loss(pad_p, p_old, adv, p_mask, **kw)
    padded.backward()
    torch.testing.assert_close(padded.detach(), full.detach())
    torch.testing.assert_close(pad_p.grad[:, :t], full_p.grad)
    n_seq = float((mask.sum(-1) > 0).sum())
    split_p = base.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 1), slice(1, 4), slice(4, 6)):
        width = int(lengths[sl].max())
        part, _ = policy_loss(split_p[sl, :width], old[sl, :width], adv[sl], mask[sl, :width],
                              global_seq_count=n_seq, **kw)
        part.backward()
        total += float(part.detach())
    assert total == pytest.approx(float(full.detach()), abs=1e-12)
    torch.testing.assert_close(split_p.grad, full_p.grad)


def test_dr_grpo_update_is_invariant_to_micro_batching(tiny_model, rl_processor):
    """The recipe's loss settings through the real update: micro-batches of 1 (each padded to its own
    length) and of 100 (one batch padded to the longest response) give the same gradients."""
    samples = rl_samples(tiny_model, rl_processor)
    gen = torch.Generator().manual_seed(1)
    for s in samples:
        if s.old_logp is not None:
            s.old_logp = s.old_logp + torch.randn(s.old_logp.shape, generator=gen) * 0.3
    cfg = load_config(RLEPConfig, None, ["algorithm.loss_agg=seq-mean-token-sum-norm", "rollout.max_new_tokens=8"])
    tiny_model.train()
    grads, losses = [], []
    for micro in (1, 100):
        tiny_model.zero_grad()
        st = accumulate_policy_gradients(tiny_model, samples, pad_id=rl_processor.pad_token_id,
                                         micro_batch_size=micro, loss_kwargs=policy_loss_kwargs(cfg))
        losses.append(st["loss"])
        grads.append(torch.cat([p.grad.flatten() for p in tiny_model.parameters() if p.grad is not None]))
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------- item 6: chunked log-probs and entropy
def _full_stats(h, head, rows, labels, temperature):
    logits = head(h).float() / temperature
    logsm = F.log_softmax(logits, dim=-1)
    return logsm[rows, labels], -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
@pytest.mark.parametrize("wrapped", [False, True])  # nn.Linear: fused function; any other head: checkpoint
def test_chunked_logprobs_equal_full_values_and_gradients(chunk, wrapped):
    gen = torch.Generator().manual_seed(0)
    m, d, v = 16, 12, 301
    linear = torch.nn.Linear(d, v)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(v, d, generator=gen) * 0.5)
        linear.bias.copy_(torch.randn(v, generator=gen))
    head = torch.nn.Sequential(linear) if wrapped else linear
    h0 = torch.randn(m, d, generator=gen)
    # tree layout: some rows predict several targets (children of one node), some none, in any order
    rows = torch.tensor([3, 0, 0, 15, 7, 3, 3, 9, 12, 1, 14, 0])
    labels = torch.randint(0, v, (rows.numel(),), generator=gen)
    g_lp, g_ent = torch.randn(rows.numel(), generator=gen), torch.randn(m, generator=gen)
    results = []
    for fn in ("full", "chunked"):
        head.zero_grad()
        h = h0.clone().requires_grad_(True)
        if fn == "full":
            lp, ent = _full_stats(h, head, rows, labels, 0.7)
        else:
            lp, ent = chunked_token_logprobs(h, rows, labels, head, temperature=0.7, with_entropy=True,
                                             chunk_size=chunk)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad, linear.weight.grad.clone(), linear.bias.grad.clone()))
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight", "d bias"), *results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    with pytest.raises(KeyeInputError, match="chunk_size"):
        chunked_token_logprobs(h0, rows, labels, head, chunk_size=0)


def test_chunked_logprobs_in_bfloat16_follow_the_full_computation():
    gen = torch.Generator().manual_seed(1)
    m, d, v = 24, 16, 257
    head = torch.nn.Linear(d, v, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=gen) * 0.3)
    h0 = torch.randn(m, d, generator=gen).to(torch.bfloat16)
    rows, labels = torch.arange(m), torch.randint(0, v, (m,), generator=gen)
    g = torch.randn(m, generator=gen)
    out = []
    for chunk in (None, 5):  # None: the full autograd graph below; 5: the fused chunked function
        head.zero_grad()
        h = h0.clone().requires_grad_(True)
        if chunk is None:
            lp, ent = _full_stats(h, head, rows, labels, 1.0)
        else:
            lp, ent = chunked_token_logprobs(h, rows, labels, head, with_entropy=True, chunk_size=chunk)
        ((lp + ent) * g).sum().backward()
        assert head.weight.grad.dtype == torch.bfloat16 and h.grad.dtype == torch.bfloat16
        out.append((lp.detach(), ent.detach(), h.grad.float(), head.weight.grad.float()))
    for name, a, b in zip(("logp", "entropy", "d hidden", "d weight"), *out):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2, msg=name)


class _SavedSizes:
    """Records the shapes autograd keeps for the backward (outside checkpointed regions); views of the
    ``params`` (e.g. the transposed lm_head weight a matmul keeps) are not counted."""

    def __init__(self, params=()):
        self.shapes: list[tuple[int, ...]] = []
        self._skip = {p.untyped_storage().data_ptr() for p in params}

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
        self._ctx.__enter__()
        return self

    def _pack(self, x):
        if x.untyped_storage().data_ptr() not in self._skip:
            self.shapes.append(tuple(x.shape))
        return x

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def vocab_rows(self, vocab: int) -> int:
        """The most rows of any saved [..., vocab] tensor (logit-like), 0 if none."""
        rows = [int(torch.tensor(s[:-1]).prod()) if len(s) > 1 else 1 for s in self.shapes if s and s[-1] == vocab]
        return max(rows, default=0)


def test_tree_logprobs_are_chunked_with_equal_values_and_gradients():
    model = make_tiny_model("1.5", seed=3)
    vocab = model.config.text.vocab_size
    prompt = [1, 2, 3, 4]
    seqs = [prompt + [10 + i for i in range(k)] + [5] for k in (9, 6, 11, 3)]
    masks = [[False] * len(prompt) + [True] * (len(s) - len(prompt)) for s in seqs]
    tree = build_tree(model.config, seqs, masks)
    n_pred = int(tree.loss_mask.sum())
    assert n_pred > 8
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])

    def run(fn):
        model.zero_grad(set_to_none=True)
        with _SavedSizes(model.parameters()) as saved:
            logp, mask, ent = fn()
            loss = (adv[:, None] * logp * mask).sum() + 0.1 * (ent * mask).sum()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logp.detach(), ent.detach(), grads, saved.vocab_rows(vocab)

    lt, et, gt, rows_t = run(lambda: tree_logprobs(model, tree, entropy=True, temperature=0.8, chunk_size=4))
    lu, eu, gu, rows_u = run(lambda: sequence_logprobs(model, seqs, masks, entropy=True, temperature=0.8,
                                                       chunk_size=4))
    torch.testing.assert_close(lt, lu, rtol=0, atol=1e-5)
    torch.testing.assert_close(et, eu, rtol=0, atol=1e-5)
    assert gt.keys() == gu.keys()
    for name in gu:
        torch.testing.assert_close(gt[name], gu[name], rtol=1e-5, atol=1e-5, msg=name)
    # nothing of full-vocabulary width is kept for the backward beyond the forward's own one-position logits
    assert rows_t <= 1 and rows_u <= 1, (rows_t, rows_u)


def test_token_logprobs_skip_padding_and_keep_no_full_logits(tiny_model, rl_processor):
    """The padded path computes only attended response positions and keeps no [tokens, vocab] tensor."""
    from keye.rl.rollout.samples import collate_samples
    from keye.train.logprobs import token_logprobs

    samples = [s for s in rl_samples(tiny_model, rl_processor) if s.valid]
    batch = collate_samples(samples, rl_processor.pad_token_id)
    vocab = tiny_model.config.text.vocab_size
    tiny_model.train()
    outs = []
    for chunk in (3, None):
        with _SavedSizes(tiny_model.parameters()) as saved:
            out = token_logprobs(tiny_model, batch, batch["responses"], batch["response_attention"],
                                 chunk_size=chunk, with_entropy=True)
        outs.append(out)
        if chunk is not None:
            assert saved.vocab_rows(vocab) <= len(samples)  # the forward's last-position logits only
    torch.testing.assert_close(outs[0].logp, outs[1].logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(outs[0].entropy, outs[1].entropy, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------ item 8: KL estimator rules
def _expected_grad(theta, ref_logp, estimator):
    """E_{x ~ pi}[grad k(x)] exactly: the per-sample loss gradient weighted by pi(x), summed over x."""
    logp = F.log_softmax(theta, dim=-1)
    weights = logp.exp().detach()
    (g,) = torch.autograd.grad((weights * kl_penalty(logp, ref_logp, estimator)).sum(), theta)
    return g


def test_kl_loss_estimators_have_the_right_expected_gradient():
    gen = torch.Generator().manual_seed(0)
    theta = (torch.randn(6, generator=gen, dtype=torch.float64) * 0.7).requires_grad_(True)
    ref_logp = F.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64) * 0.7, dim=-1)
    logp = F.log_softmax(theta, dim=-1)
    p, q = logp.exp(), ref_logp.exp()
    (kl_pq,) = torch.autograd.grad((p * (logp - ref_logp)).sum(), theta, retain_graph=True)  # KL(pi || ref)
    (kl_qp,) = torch.autograd.grad((q * (ref_logp - logp)).sum(), theta)  # KL(ref || pi)
    assert float(kl_pq.norm()) > 1e-2
    # k1 = logp - ref: its expected gradient is E[grad logp] = 0, whatever the distance to ref
    torch.testing.assert_close(_expected_grad(theta, ref_logp, "k1"), torch.zeros(6, dtype=torch.float64))
    # k2 = (logp - ref)^2 / 2: E[(logp - ref) grad logp] = grad KL(pi || ref)
    torch.testing.assert_close(_expected_grad(theta, ref_logp, "k2"), kl_pq)
    # k3 = r - 1 - log r, r = ref / pi: E[(1 - r) grad logp] = -sum ref grad logp = grad KL(ref || pi)
    for est in ("k3", "low_var_kl"):
        torch.testing.assert_close(_expected_grad(theta, ref_logp, est), kl_qp)


def test_kl_loss_gradient_per_token_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    zero_adv = torch.zeros(1, dtype=torch.float64)
    for est, grad in (("k2", logp.detach() - ref), ("k3", 1.0 - (ref - logp.detach()).exp())):
        logp.grad = None
        loss, _ = policy_loss(logp, logp.detach(), zero_adv, torch.ones_like(ref), ref_logp=ref, kl_coef=0.5,
                              kl_estimator=est)
        loss.backward()
        torch.testing.assert_close(logp.grad, 0.5 * grad / 3, msg=est)


def test_k1_kl_loss_is_rejected():
    lp = torch.zeros(1, 2)
    with pytest.raises(KeyeConfigError, match="k1"):
        policy_loss(lp, lp, torch.zeros(1), torch.ones_like(lp), ref_logp=lp - 1, kl_coef=0.1, kl_estimator="k1")
    # as a logged value (no coefficient) k1 stays available
    _, stats = policy_loss(lp, lp, torch.zeros(1), torch.ones_like(lp), ref_logp=lp - 1, kl_estimator="k1")
    assert stats["kl"] == pytest.approx(1.0)
    over = ["algorithm.reference=true", "algorithm.kl_coef=0.1"]
    with pytest.raises(KeyeConfigError, match=r"algorithm\.kl_estimator.*k1.*k2.*k3.*low_var_kl"):
        validate(load_config(RLEPConfig, None, [*over, "algorithm.kl_estimator=k1"]))
    for est in ("k2", "k3", "low_var_kl"):
        cfg = load_config(RLEPConfig, None, [*over, f"algorithm.kl_estimator={est}"])
        validate(cfg)
        assert policy_loss_kwargs(cfg)["kl_estimator"] == est
    # k1 as verl uses it: a reward penalty (tested in test_update), which needs the reference model too
    validate(load_config(RLEPConfig, None, ["algorithm.reference=true", "algorithm.kl_reward_coef=0.01"]))
    with pytest.raises(KeyeConfigError, match="algorithm.kl_reward_coef"):
        validate(load_config(RLEPConfig, None, ["algorithm.kl_reward_coef=0.01"]))


def test_rl_config_rejects_the_sft_only_preprocessor_override():
    from keye.rl.config import RLEPConfig, validate
    from keye.train.config import load_config

    cfg = load_config(RLEPConfig, None, [])
    cfg.model.preprocessor = {"max_pixels": 25088}
    with pytest.raises(KeyeConfigError, match="model.preprocessor is an SFT option"):
        validate(cfg)
