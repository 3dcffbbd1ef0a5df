"""PPO-family policy losses: clip-higher, dual clip, GSPO sequence ratio, KL estimators, aggregation.

Formulas (training.md §1.3 step 9, §2.5, §7.4, §8.4-8.7), per response token ``t`` of sequence ``i``:

- token ratio ``rho = exp(logp - old_logp)``; GSPO sequence ratio
  ``s_i = exp(mean_t (logp - old_logp))``, used per token as ``s_i * pi / sg(pi)`` so that the value is
  ``s_i`` and the gradient is ``s_i * grad logp`` (GSPO paper's token form; ``sg`` = stop-gradient);
- ``L1 = -A * rho``, ``L2 = -A * clip(rho, 1 - eps_low, 1 + eps_high)``, ``L = max(L1, L2)``;
- dual clip (``c = dual_clip``) for ``A < 0``: ``L = min(L, -A * c)``;
- KL to a reference: ``k1 = logp - ref``, ``k2 = (logp - ref)^2 / 2``, ``k3 = exp(ref - logp) - (ref - logp) - 1``
  (log-ratio clamped to +-20, value clamped to +-10, as verl's ``low_var_kl``; ``"low_var_kl"`` is the same
  estimator), added as ``kl_coef * agg(kl)``. As a *loss* only k2 and k3 are allowed (verl's rule): on
  samples of pi the expected gradient of k1 is ``E[grad logp] = 0``, so a k1 loss term never pulls towards
  the reference (it is an unbiased KL *value*, fit for logging or a reward penalty). k2's expected gradient is
  ``grad KL(pi || ref)``; k3's is ``grad KL(ref || pi)`` (both zero exactly at ``pi = ref``).

Aggregation (``loss_agg``) over the mask:

- ``"token-mean"``: ``sum(L) / n_tokens`` (RLEP/DAPO);
- ``"seq-mean-token-mean"``: mean over sequences of each sequence's token mean (original GRPO, GSPO);
- ``"seq-mean-token-sum"``: mean over sequences of each sequence's token sum;
- ``"seq-mean-token-sum-norm"``: ``sum(L) / (loss_scale_factor * n_seqs)`` (Dr.GRPO). The factor must be a
  constant of the run (Dr.GRPO and verl use the maximum response length): the padded width of a
  micro-batch would make the gradient scale depend on how the batch was cut, so there is no default.

``global_token_count`` / ``global_seq_count`` replace the local ``n_tokens`` / ``n_seqs`` by the count over
the whole optimiser step (every micro-batch on every rank), so that summing the micro-batch losses (and
all-reducing gradients by sum) gives exactly the full-batch loss; only sequences with at least one masked
token count as sequences.

Truncated importance sampling (TIS) for the rollout-engine / learner mismatch: the rollout engine (vLLM in
bf16, other kernels) samples from ``pi_rollout``, slightly different from the learner's ``pi_old`` that the
ratio above is taken against. With ``tis_cap = C`` each token's policy-gradient term is multiplied by
``w = sg(min(exp(old_logp - rollout_logp), C))``, verl's ``tis_imp_ratio_cap`` (verl PR #2953,
``compute_policy_loss_vanilla``: ``tis_imp_ratio = torch.exp(old_log_prob - rollout_log_probs)``,
``torch.clamp(tis_imp_ratio, max=tis_imp_ratio_cap)``, ``pg_losses = pg_losses * tis_imp_ratio``, applied after
the dual clip and before aggregation), after "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (F. Yao et al., 2025). The KL and entropy terms are not reweighted (as verl).
"""

from __future__ import annotations

import torch

from keye.errors import KeyeConfigError, KeyeInputError

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")
KL_LOSS_ESTIMATORS = ("k2", "k3", "low_var_kl")  # the ones whose gradient is a KL gradient (module doc)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_token_count: float | int | torch.Tensor | None = None,
    global_seq_count: float | int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce per-token values [B, T] to a scalar with one of ``LOSS_AGG_MODES`` (see module doc).

    Args:
        values: float [B, T]. mask: bool/float [B, T] (1 on tokens that count).
        global_token_count: denominator of ``token-mean`` (default: this batch's masked token count).
        global_seq_count: number of sequences in the seq-mean modes (default: this batch's sequences
            that have at least one masked token).
        loss_scale_factor: Dr.GRPO constant, required by ``seq-mean-token-sum-norm`` (e.g. the maximum
            response length of the run; never the padded width).
    Returns:
        0-d tensor (0 when nothing is masked in).
    """
    if mode not in LOSS_AGG_MODES:
        raise KeyeConfigError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {mode!r}")
    if values.shape != mask.shape or values.dim() != 2:
        raise KeyeInputError(f"values and mask must both be [B, T], got {tuple(values.shape)} and {tuple(mask.shape)}")
    m = mask.to(values.dtype)
    masked = values * m
    if mode == "token-mean":
        den = m.sum() if global_token_count is None else torch.as_tensor(global_token_count, dtype=values.dtype)
        return masked.sum() / den.clamp(min=1)
    tokens_per_seq = m.sum(dim=-1)
    n_seq = (tokens_per_seq > 0).to(values.dtype).sum()
    if global_seq_count is not None:
        n_seq = torch.as_tensor(global_seq_count, dtype=values.dtype)
    n_seq = n_seq.clamp(min=1)
    seq_sum = masked.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / n_seq
    if mode == "seq-mean-token-mean":
        return (seq_sum / tokens_per_seq.clamp(min=1)).sum() / n_seq
    if loss_scale_factor is None:
        raise KeyeConfigError(
            "loss_agg 'seq-mean-token-sum-norm' needs loss_scale_factor, a constant of the run such as the maximum "
            "response length (the padded width would make the loss depend on the micro-batch split)"
        )
    factor = float(loss_scale_factor)
    if factor <= 0:
        raise KeyeConfigError(f"loss_scale_factor must be > 0, got {factor}")
    return seq_sum.sum() / (factor * n_seq)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from samples of pi_theta.

    ``"k1"``: ``logp - ref_logp`` (unbiased, high variance, can be negative; zero expected gradient, so not
    a loss). ``"k2"``: ``(logp - ref_logp)^2 / 2`` (verl ``mse``). ``"k3"`` / ``"low_var_kl"``:
    ``exp(ref - logp) - (ref - logp) - 1`` with the log-ratio clamped to [-20, 20] and the result clamped to
    [-10, 10] (verl ``low_var_kl``; non-negative, low variance).
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp).square()
    if estimator in ("k3", "low_var_kl"):
        log_r = (ref_logp - logp).clamp(-20.0, 20.0)
        return (log_r.exp() - log_r - 1).clamp(-10.0, 10.0)
    raise KeyeConfigError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> float:
    n = float(m.sum())
    return float((x * m).sum()) / n if n > 0 else 0.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    loss_agg: str = "token-mean",
    global_token_count: float | int | torch.Tensor | None = None,
    global_seq_count: float | int | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    max_log_ratio: float = 20.0,
    rollout_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    has_rollout_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss of one (micro-)batch.

    Args:
        logp: float [B, T] log-probs of the response tokens under the policy being trained (with grad).
        old_logp: float [B, T] log-probs under the behaviour ("old") policy (no grad needed).
        advantages: float [B] (broadcast over tokens) or [B, T].
        mask: bool/float [B, T], 1 on response tokens (first EOS included, prompt/padding excluded).
        eps_low / eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` (clip-higher: eps_high > eps_low).
        dual_clip: ``c > 1`` bounds the loss of negative-advantage tokens at ``-A * c``; None disables.
        ratio_level: ``"token"`` (PPO/GRPO/DAPO) or ``"sequence"`` (GSPO; the GSPO paper pairs it with
            ``loss_agg="seq-mean-token-mean"`` and much smaller eps, e.g. 3e-4 / 4e-4). The sequence
            log-ratio is clamped to ``<= 10`` as in verl.
        loss_agg, global_token_count, global_seq_count, loss_scale_factor: see :func:`aggregate`.
        ref_logp / kl_coef / kl_estimator: optional KL-to-reference loss term (:func:`kl_penalty`); with
            ``kl_coef > 0`` the estimator must be one of ``KL_LOSS_ESTIMATORS`` (k1 is only logged).
        entropy: float [B, T] per-token entropy (for stats, and an entropy bonus if ``entropy_coef > 0``).
        max_log_ratio: token log-ratios are clamped to +-this before ``exp`` (numerical safety).
        rollout_logp: float [B, T] log-probs the rollout engine reported for the sampled tokens (the
            distribution it actually sampled from); used only with ``tis_cap``. None: no row has them (e.g. a
            micro-batch of replayed rows), every weight is 1.
        tis_cap: truncated importance sampling (module doc): multiply each token's policy-gradient term by
            ``min(exp(old_logp - rollout_logp), tis_cap)`` (no gradient through the weight); must be >= 1.
            None (default) leaves the loss exactly as without it.
        has_rollout_logp: bool [B], False for rows whose engine reported no log-probs (replayed samples);
            their weight is 1, whatever ``rollout_logp`` holds there (collate_samples writes zeros). None:
            every row has them.
    Returns:
        (loss, stats). ``loss`` is a 0-d tensor: ``pg + kl_coef * kl - entropy_coef * entropy``, each term
        aggregated with ``loss_agg``. ``stats`` (floats over this batch's masked tokens): ``pg_loss``,
        ``clip_frac_high`` (A > 0 and ratio > 1 + eps_high), ``clip_frac_low`` (A < 0 and ratio <
        1 - eps_low), ``clip_frac`` (either), ``dual_clip_frac`` (A < 0 and the dual bound active),
        ``approx_kl`` (k3 estimate of KL(old || new)), ``ratio_mean``, ``ratio_max``, ``ratio_min``,
        ``num_tokens``, and ``kl`` / ``entropy`` when given. With ``tis_cap``, over the masked tokens (rows
        without rollout log-probs count with weight 1, unclipped, no difference, so that token-weighted means
        over micro-batches stay exact): ``tis_weight_mean`` (mean weight after the cap), ``tis_clip_frac``
        (fraction whose ratio exceeded the cap) and ``rollout_logp_abs_diff`` (mean ``|old_logp -
        rollout_logp|``, the engine mismatch).
    """
    _check_settings(ratio_level, eps_low, eps_high, dual_clip, kl_coef, kl_estimator, tis_cap)
    adv = _token_advantages(advantages, logp, old_logp, mask)
    m = mask.to(logp.dtype)
    old_logp = old_logp.detach()

    log_ratio = (logp - old_logp).clamp(-max_log_ratio, max_log_ratio)
    if ratio_level == "sequence":
        n_tok = m.sum(dim=-1).clamp(min=1)
        seq_log_ratio = ((log_ratio * m).sum(dim=-1) / n_tok).clamp(max=10.0)
        log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]
    ratio = log_ratio.exp()
    pg, dual_active = _clipped_objective(adv, ratio, eps_low, eps_high, dual_clip)
    tis = None
    if tis_cap is not None:
        tis = _tis_weights(old_logp, rollout_logp, has_rollout_logp, float(tis_cap))
        pg = pg * tis[0].to(pg.dtype)

    agg_kw = dict(global_token_count=global_token_count, global_seq_count=global_seq_count,
                  loss_scale_factor=loss_scale_factor)
    pg_loss = aggregate(pg, m, loss_agg, **agg_kw)
    loss = pg_loss
    stats: dict[str, float] = {}
    if ref_logp is not None:
        if ref_logp.shape != logp.shape:
            raise KeyeInputError(f"ref_logp has shape {tuple(ref_logp.shape)}, logp {tuple(logp.shape)}")
        kl = kl_penalty(logp, ref_logp.detach(), kl_estimator)
        kl_loss = aggregate(kl, m, loss_agg, **agg_kw)
        if kl_coef:
            loss = loss + kl_coef * kl_loss
        stats["kl"] = _masked_mean(kl.detach(), m)
    elif kl_coef:
        raise KeyeInputError("kl_coef > 0 needs ref_logp (log-probs of the reference model)")
    if entropy is not None:
        if entropy.shape != logp.shape:
            raise KeyeInputError(f"entropy has shape {tuple(entropy.shape)}, logp {tuple(logp.shape)}")
        if entropy_coef:
            loss = loss - entropy_coef * aggregate(entropy, m, loss_agg, **agg_kw)
        stats["entropy"] = _masked_mean(entropy.detach(), m)
    stats.update(_ratio_stats(logp, old_logp, adv, ratio, m, dual_active, eps_low, eps_high, max_log_ratio))
    stats["pg_loss"] = float(pg_loss.detach())
    if tis is not None:
        w, log_w = tis
        stats.update(tis_weight_mean=_masked_mean(w.to(m.dtype), m),
                     tis_clip_frac=_masked_mean((log_w.exp() > tis_cap).to(m.dtype), m),
                     rollout_logp_abs_diff=_masked_mean(log_w.abs().to(m.dtype), m))
    return loss, stats


def _check_settings(ratio_level: str, eps_low: float, eps_high: float, dual_clip: float | None, kl_coef: float,
                    kl_estimator: str, tis_cap: float | None) -> None:
    """Raise :class:`KeyeConfigError` for a loss setting :func:`policy_loss` cannot use, naming it."""
    if ratio_level not in RATIO_LEVELS:
        raise KeyeConfigError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if eps_low < 0 or eps_high < 0:
        raise KeyeConfigError(f"clip epsilons must be >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise KeyeConfigError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    if kl_coef and kl_estimator not in KL_LOSS_ESTIMATORS:
        raise KeyeConfigError(
            f"kl_estimator {kl_estimator!r} cannot be a loss term (kl_coef={kl_coef}): k1's expected gradient is "
            f"zero; use one of {KL_LOSS_ESTIMATORS}"
        )
    if tis_cap is not None and not tis_cap >= 1.0:
        raise KeyeConfigError(
            f"tis_cap must be >= 1 (or None), got {tis_cap}: a cap below 1 scales down every token, on-policy ones "
            "included"
        )


def _token_advantages(advantages: torch.Tensor, logp: torch.Tensor, old_logp: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """The advantages as [B, T] in ``logp``'s dtype (a [B] vector broadcast over tokens), without gradient;
    raises :class:`KeyeInputError` for shapes that do not fit."""
    if logp.dim() != 2 or old_logp.shape != logp.shape or mask.shape != logp.shape:
        raise KeyeInputError(
            f"logp, old_logp and mask must all be [B, T]; got {tuple(logp.shape)}, {tuple(old_logp.shape)}, "
            f"{tuple(mask.shape)}"
        )
    if advantages.dim() == 1:
        if advantages.shape[0] != logp.shape[0]:
            raise KeyeInputError(f"advantages [B] has {advantages.shape[0]} rows, logp has {logp.shape[0]}")
        adv = advantages[:, None].expand_as(logp)
    elif advantages.shape == logp.shape:
        adv = advantages
    else:
        raise KeyeInputError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)}")
    return adv.to(logp.dtype).detach()


def _clipped_objective(adv: torch.Tensor, ratio: torch.Tensor, eps_low: float, eps_high: float,
                       dual_clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token PPO loss ``max(-A r, -A clip(r))`` (dual-clipped for negative advantages when ``dual_clip``)
    and where the dual bound is active."""
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    neg = adv < 0
    dual_active = torch.zeros_like(neg)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_active = neg & (pg > bound)
        pg = torch.where(neg, torch.minimum(pg, bound), pg)
    return pg, dual_active


@torch.no_grad()
def _ratio_stats(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, ratio: torch.Tensor, m: torch.Tensor,
                 dual_active: torch.Tensor, eps_low: float, eps_high: float, max_log_ratio: float) -> dict[str, float]:
    """Clip fractions, the k3 estimate of KL(old || new), ratio statistics and the token count over ``m``."""
    r = ratio.detach()
    high = (adv > 0) & (r > 1.0 + eps_high)
    low = (adv < 0) & (r < 1.0 - eps_low)
    tok_log_ratio = (logp.detach() - old_logp).clamp(-max_log_ratio, max_log_ratio)
    sel = m.bool()
    return dict(clip_frac_high=_masked_mean(high.to(m.dtype), m), clip_frac_low=_masked_mean(low.to(m.dtype), m),
                clip_frac=_masked_mean((high | low).to(m.dtype), m),
                dual_clip_frac=_masked_mean(dual_active.to(m.dtype), m),
                approx_kl=_masked_mean(tok_log_ratio.exp() - 1 - tok_log_ratio, m), ratio_mean=_masked_mean(r, m),
                ratio_max=float(r[sel].max()) if bool(sel.any()) else 1.0,
                ratio_min=float(r[sel].min()) if bool(sel.any()) else 1.0, num_tokens=float(m.sum()))


def _tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, has_rollout_logp: torch.Tensor | None,
                 cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(capped weights [B, T], ``old_logp - rollout_logp`` [B, T] with 0 in rows without rollout log-probs);
    no gradient."""
    b = old_logp.shape[0]
    with torch.no_grad():
        if rollout_logp is None:
            log_w = torch.zeros_like(old_logp)
        else:
            if rollout_logp.shape != old_logp.shape:
                raise KeyeInputError(f"rollout_logp has shape {tuple(rollout_logp.shape)}, logp {tuple(old_logp.shape)}")
            log_w = old_logp.detach() - rollout_logp.detach().to(old_logp)
            if has_rollout_logp is not None:
                if has_rollout_logp.shape != (b,):
                    raise KeyeInputError(f"has_rollout_logp must be [B={b}], got {tuple(has_rollout_logp.shape)}")
                rows = has_rollout_logp.to(device=old_logp.device, dtype=torch.bool)
                log_w = torch.where(rows[:, None], log_w, torch.zeros_like(log_w))
        # verl's form: exp first, then clamp (an overflow to inf clamps to the cap)
        w = torch.exp(log_w).clamp(max=cap)
    return w, log_w
