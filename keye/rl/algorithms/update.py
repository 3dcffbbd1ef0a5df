"""Glue from scored samples to gradients: advantages per sample, old/reference log-probs, and one
mini-batch's policy-gradient accumulation over micro-batches normalised by the global token count.

Typical RLEP step (the recipe adds config, logging, optimizer and checkpoints)::

    fresh = engine.generate(prompts, G)                                   # G per prompt
    samples = add_replay(fresh, pool, M, encode=..., eos_id=..., max_response_len=...)
    scores = scorer(samples); set_scores(samples, scores)                 # same reward for replay
    fill_logprobs(model, samples, pad_id=pad, micro_batch_size=8)         # old log-probs, replay included
    assign_advantages(samples, std="unbiased", eps=1e-6, difficulty="flat")  # (+ kl_reward_coef: needs ref_logp)
    for _ in range(ppo_epochs):
        for idx in group_minibatches(group_ids, groups_per_minibatch):
            stats = accumulate_policy_gradients(model, [samples[i] for i in idx], pad_id=pad,
                                                micro_batch_size=8, loss_kwargs=dict(dual_clip=10.0))
            clip_grad_norm_(...); optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from keye.errors import KeyeInputError
from keye.rl.algorithms.advantages import DifficultyCurve, difficulty_reshape, group_advantages
from keye.rl.algorithms.losses import policy_loss
from keye.rl.rollout.samples import RolloutSample, collate_samples
from keye.train.logprobs import DEFAULT_CHUNK_TOKENS, token_logprobs


def set_scores(samples: Sequence[RolloutSample], scores: Any) -> None:
    """Copy ``scores.rewards`` / ``scores.passed`` (a :class:`keye.rl.rollout.scoring.Scores`) onto the samples."""
    if len(scores.rewards) != len(samples) or len(scores.passed) != len(samples):
        raise KeyeInputError(f"{len(scores.rewards)} rewards / {len(scores.passed)} pass flags for {len(samples)} samples")
    for s, r, ok in zip(samples, scores.rewards, scores.passed):
        s.reward, s.passed = float(r), bool(ok)


def assign_advantages(
    samples: Sequence[RolloutSample],
    *,
    std: str = "unbiased",
    eps: float = 1e-6,
    difficulty: DifficultyCurve | str | Sequence[Sequence[float]] | None = None,
    kl_reward_coef: float = 0.0,
) -> torch.Tensor:
    """Group-normalise every sample's ``reward`` within its ``group`` (fresh and replay together, invalid
    rows excluded), optionally reshape by the group's *fresh* pass rate, store ``sample.advantage``.

    ``kl_reward_coef > 0`` is the KL penalty in the reward (verl's ``use_kl_in_reward``, the place for the
    k1 estimator, whose gradient as a loss term is zero in expectation): the normalised reward of a sample
    is ``reward - kl_reward_coef * sum_t (old_logp - ref_logp)`` (``old_logp`` / ``ref_logp`` must be
    filled first); the penalty is stored in ``metadata["kl_reward_penalty"]``, ``reward`` is left as scored.

    Returns:
        float32 [B] advantages in sample order (0 for invalid samples).
    Raises:
        KeyeInputError: a valid sample without a reward (or, with ``difficulty``, without ``passed``; with
            ``kl_reward_coef``, without ``old_logp`` / ``ref_logp``).
    """
    if not samples:
        return torch.zeros(0)
    for i, s in enumerate(samples):
        if s.valid and s.reward is None:
            raise KeyeInputError("sample has no reward; score the samples first", item=i)
    penalties = [0.0] * len(samples)
    if kl_reward_coef:
        for i, s in enumerate(samples):
            if not s.valid:
                continue
            if s.old_logp is None or s.ref_logp is None:
                raise KeyeInputError("the KL reward penalty needs old_logp and ref_logp; run fill_logprobs with the "
                                     "policy and the reference model first", item=i)
            n = s.num_tokens
            penalties[i] = kl_reward_coef * float((s.old_logp[:n].double() - s.ref_logp[:n].double()).sum())
            s.metadata["kl_reward_penalty"] = penalties[i]
    rewards = torch.tensor([float(s.reward) - k if s.valid else 0.0 for s, k in zip(samples, penalties)],
                           dtype=torch.float64)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    valid = torch.tensor([s.valid for s in samples], dtype=torch.bool)
    adv = group_advantages(rewards, groups, valid, std=std, eps=eps)
    if difficulty is not None:
        if any(s.valid and s.passed is None for s in samples):
            raise KeyeInputError("difficulty reshaping needs sample.passed on every valid sample")
        passed = torch.tensor([bool(s.passed) for s in samples], dtype=torch.bool)
        fresh = torch.tensor([s.valid and s.source == "rollout" for s in samples], dtype=torch.bool)
        adv, _ = difficulty_reshape(adv, passed, groups, difficulty, counted=fresh)
    adv = adv.float()
    for s, a in zip(samples, adv.tolist()):
        s.advantage = a
    return adv


def _micro_batches(samples: Sequence[RolloutSample], size: int) -> list[list[RolloutSample]]:
    if size < 1:
        raise KeyeInputError(f"micro_batch_size must be >= 1, got {size}")
    return [list(samples[i : i + size]) for i in range(0, len(samples), size)]


@torch.no_grad()
def fill_logprobs(model: torch.nn.Module, samples: Sequence[RolloutSample], *, pad_id: int,
                  micro_batch_size: int = 8, temperature: float = 1.0, target: str = "old_logp",
                  chunk_size: int | None = DEFAULT_CHUNK_TOKENS) -> None:
    """Compute log-probs of every valid sample's response with ``model`` and store them in
    ``sample.old_logp`` (behaviour policy = the current actor, replayed samples included, as RLEP does) or
    ``sample.ref_logp`` (``target="ref_logp"`` with the reference model)."""
    if target not in ("old_logp", "ref_logp"):
        raise KeyeInputError(f"target must be 'old_logp' or 'ref_logp', got {target!r}")
    was_training = model.training
    model.eval()
    try:
        for mb in _micro_batches([s for s in samples if s.valid], micro_batch_size):
            batch = collate_samples(mb, pad_id)
            out = token_logprobs(model, batch, batch["responses"], batch["response_attention"],
                                 temperature=temperature, chunk_size=chunk_size)
            for i, s in enumerate(mb):
                setattr(s, target, out.logp[i, : s.num_tokens].float().cpu())
    finally:
        model.train(was_training)


def _dist_sum(values: list[float], device: torch.device) -> tuple[list[float], int]:
    """All-reduce (sum) a few counts across data-parallel ranks; returns them and the world size."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values, 1
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return t.tolist(), torch.distributed.get_world_size()


def accumulate_policy_gradients(model: torch.nn.Module, samples: Sequence[RolloutSample], *, pad_id: int,
                                micro_batch_size: int = 8, temperature: float = 1.0,
                                loss_kwargs: Mapping[str, Any] | None = None, exclude_ids: Sequence[int] = (),
                                chunk_size: int | None = DEFAULT_CHUNK_TOKENS,
                                with_entropy: bool = False) -> dict[str, float]:
    """Forward/backward one PPO mini-batch (this rank's share), micro-batch by micro-batch.

    Each micro-batch loss is normalised by the token (and sequence) count of the *whole* mini-batch over
    all data-parallel ranks, so the accumulated gradient is the full mini-batch gradient whatever the
    micro-batching (with DDP/FSDP's gradient averaging compensated by the world size). Gradients are
    accumulated into ``.grad``; the caller clips, steps and zeroes.

    Args:
        samples: with ``advantage`` and ``old_logp`` set (and ``ref_logp`` when ``kl_coef > 0``).
        loss_kwargs: keyword arguments of :func:`keye.rl.algorithms.losses.policy_loss` (eps, dual_clip, loss_agg, ...).
        exclude_ids: response token ids kept out of the loss, in addition to the model's image/video
            placeholder ids (always excluded); the global counts are of the tokens that enter the loss.
    Returns:
        stats: token-weighted means of the :func:`policy_loss` stats over this rank's micro-batches, plus
        ``loss`` (the mini-batch loss), ``tokens`` and ``sequences`` (global counts).
    """
    kwargs = dict(loss_kwargs or {})
    use_ref = bool(kwargs.get("kl_coef", 0.0))
    live = [s for s in samples if s.num_tokens > 0]
    for i, s in enumerate(live):
        if s.advantage is None or s.old_logp is None or (use_ref and s.ref_logp is None):
            raise KeyeInputError("sample lacks advantage / old_logp (/ ref_logp); run assign_advantages and "
                                 "fill_logprobs first", item=i)
    device = next(model.parameters()).device
    core = getattr(model, "module", model)
    # sampled vision placeholder ids are scored as text but never trained on (training.md §8.6)
    placeholders = [getattr(core.config, k) for k in ("image_token_id", "video_token_id") if hasattr(core, "config")]
    exclude_ids = sorted(set(exclude_ids) | {int(i) for i in placeholders if i is not None})
    excl = torch.tensor(exclude_ids, dtype=torch.long)
    loss_tokens = [int((~torch.isin(s.response_ids[: s.num_tokens], excl)).sum()) for s in live]
    local = [float(sum(loss_tokens)), float(sum(1 for k in loss_tokens if k > 0))]
    (n_tok, n_seq), world = _dist_sum(local, device)
    totals: dict[str, float] = {}
    weight_sum = 0.0
    loss_sum = 0.0
    for mb in _micro_batches(live, micro_batch_size):
        batch = collate_samples(mb, pad_id, exclude_ids)
        out = token_logprobs(model, batch, batch["responses"], batch["response_attention"],
                             temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy)
        loss, stats = policy_loss(
            out.logp, batch["old_logp"].to(out.logp.device), batch["advantages"].to(out.logp.device),
            batch["response_mask"].to(out.logp.device),
            ref_logp=batch["ref_logp"].to(out.logp.device) if use_ref else None,
            entropy=out.entropy, global_token_count=max(n_tok, 1.0), global_seq_count=max(n_seq, 1.0), **kwargs,
        )
        (loss * world).backward()
        loss_sum += float(loss.detach())
        w = stats["num_tokens"]
        weight_sum += w
        for k, v in stats.items():
            if k not in ("num_tokens", "pg_loss", "ratio_max", "ratio_min"):
                totals[k] = totals.get(k, 0.0) + v * w
        totals["ratio_max"] = max(totals.get("ratio_max", float("-inf")), stats["ratio_max"])
        totals["ratio_min"] = min(totals.get("ratio_min", float("inf")), stats["ratio_min"])
    result = {k: (v / weight_sum if weight_sum and k not in ("ratio_max", "ratio_min") else v) for k, v in totals.items()}
    result.update(loss=loss_sum, tokens=n_tok, sequences=n_seq)
    return result
