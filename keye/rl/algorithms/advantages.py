"""Group-relative advantages: GRPO, Dr.GRPO (no std), RLEP enlarged groups, difficulty reshaping.

Every function works on a flat batch of responses tagged by an integer group id (the prompt's uid), so
group identity survives any shuffling or re-ordering (training.md §8.3); :func:`rlep_advantages` is the
2-D convenience for the ``[n_prompts, G]`` fresh + ``[n_prompts, M]`` replay layout.

Conventions (training.md §1.3 step 7, verl ``compute_grpo_outcome_advantage``):

- ``A_i = (r_i - mean_g) / (std_g + eps)`` over the *valid* members of the group, broadcast to every
  response token by the loss;
- ``std="unbiased"`` (n - 1, the RLEP/verl reference, default), ``"population"`` (n) or ``"none"``
  (Dr.GRPO: ``A_i = r_i - mean_g``);
- ``eps = 1e-6`` (reference value);
- a group with a single valid member gets mean 0 and std 1 (the verl convention), i.e. ``A = r / (1 + eps)``
  (``r`` with ``std="none"``);
- invalid members (replay slots of a question with fewer than M stored answers) enter no statistic and
  get advantage exactly 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from keye.errors import KeyeConfigError, KeyeInputError

STD_MODES = ("unbiased", "population", "none")


def _check_flat(rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise KeyeInputError(
            f"rewards and group_ids must be 1-D of equal length, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.dtype not in (torch.int64, torch.int32):
        raise KeyeInputError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    if bool((group_ids < 0).any()):
        raise KeyeInputError("group_ids must be >= 0")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    elif valid.shape != rewards.shape:
        raise KeyeInputError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}")
    valid = valid.bool()
    if not bool(torch.isfinite(rewards[valid]).all()):
        raise KeyeInputError("rewards of valid samples must be finite")
    return valid


def group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None, *, std: str = "unbiased"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, group std and group size (valid members only).

    Args:
        rewards: float [B]. group_ids: int [B] (any non-negative labels). valid: bool [B] or None (all).
        std: ``"unbiased"`` (n - 1), ``"population"`` (n) or ``"none"`` (std returned as 1).
    Returns:
        (mean [B], std [B], count [B]) of each sample's group, computed in float64 and returned in the
        rewards' dtype; groups with one valid member get mean 0 and std 1 (the reference convention).
    """
    if std not in STD_MODES:
        raise KeyeConfigError(f"std must be one of {STD_MODES}, got {std!r}")
    valid = _check_flat(rewards, group_ids, valid)
    r = torch.where(valid, rewards, torch.zeros_like(rewards)).double()
    w = valid.double()
    n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=rewards.device).index_add_(0, group_ids.long(), w)
    total = torch.zeros_like(count).index_add_(0, group_ids.long(), r)
    mean_g = total / count.clamp(min=1)
    dev = (r - mean_g[group_ids.long()]) * w
    sq = torch.zeros_like(count).index_add_(0, group_ids.long(), dev * dev)
    if std == "unbiased":
        std_g = (sq / (count - 1).clamp(min=1)).sqrt()
    elif std == "population":
        std_g = (sq / count.clamp(min=1)).sqrt()
    else:
        std_g = torch.ones_like(count)
    single = count <= 1
    mean_g = torch.where(single, torch.zeros_like(mean_g), mean_g)
    std_g = torch.where(single, torch.ones_like(std_g), std_g)
    idx = group_ids.long()
    return mean_g[idx].to(rewards.dtype), std_g[idx].to(rewards.dtype), count[idx].to(rewards.dtype)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    std: str = "unbiased",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)`` (``r - mean_g`` for ``std="none"``).

    Args:
        rewards: float [B] scalar reward per response.
        group_ids: int [B]; samples with the same id form one group (fresh and replayed alike).
        valid: bool [B]; False rows are excluded from every statistic and get advantage 0.
        std: see :func:`group_stats`. eps: added to the std (not used with ``std="none"``).
    Returns:
        float [B] advantages (rewards' dtype).
    """
    mean, sd, _ = group_stats(rewards, group_ids, valid, std=std)
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    centred = rewards.double() - mean.double()
    adv = centred if std == "none" else centred / (sd.double() + eps)
    return torch.where(valid, adv, torch.zeros_like(adv)).to(rewards.dtype)


def rlep_advantages(
    fresh_rewards: torch.Tensor,
    replay_rewards: torch.Tensor | None = None,
    replay_valid: torch.Tensor | None = None,
    *,
    std: str = "unbiased",
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLEP advantages over enlarged groups of G fresh + M replayed responses per prompt.

    Args:
        fresh_rewards: float [P, G], rewards of the current policy's rollouts.
        replay_rewards: float [P, M], rewards of the replayed successes, scored by the *same* reward
            function (values of invalid slots are ignored); None or M = 0 is plain GRPO.
        replay_valid: bool [P, M]; False marks a missing slot (the question had fewer than M stored
            answers). Missing slots are not empty responses: they enter no mean/std and get advantage 0.
    Returns:
        (fresh_adv [P, G], replay_adv [P, M]) normalised over the G + (valid) M members of each row.
    """
    if fresh_rewards.dim() != 2:
        raise KeyeInputError(f"fresh_rewards must be [P, G], got {tuple(fresh_rewards.shape)}")
    p, g = fresh_rewards.shape
    if replay_rewards is None:
        replay_rewards = fresh_rewards.new_zeros(p, 0)
    if replay_rewards.dim() != 2 or replay_rewards.shape[0] != p:
        raise KeyeInputError(f"replay_rewards must be [P={p}, M], got {tuple(replay_rewards.shape)}")
    m = replay_rewards.shape[1]
    if replay_valid is None:
        replay_valid = torch.ones(p, m, dtype=torch.bool, device=fresh_rewards.device)
    if replay_valid.shape != replay_rewards.shape:
        raise KeyeInputError(f"replay_valid has shape {tuple(replay_valid.shape)}, expected {(p, m)}")
    rewards = torch.cat([fresh_rewards, torch.where(replay_valid.bool(), replay_rewards, 0.0)], dim=1)
    valid = torch.cat([torch.ones_like(fresh_rewards, dtype=torch.bool), replay_valid.bool()], dim=1)
    ids = torch.arange(p, device=fresh_rewards.device)[:, None].expand(p, g + m)
    adv = group_advantages(rewards.reshape(-1), ids.reshape(-1), valid.reshape(-1), std=std, eps=eps)
    adv = adv.view(p, g + m)
    return adv[:, :g], adv[:, g:]


# ------------------------------------------------------------------------------- difficulty awareness
# Presets of the pass-rate multiplier g(pass_rate). The published description (training.md §6) is
# qualitative: amplify groups with mixed outcomes ("highly exploratory"), shrink near-solved ones. The
# shapes below are our choice [inference]; "flat" disables reshaping.
DIFFICULTY_PRESETS: dict[str, tuple[tuple[float, float], ...]] = {
    "flat": ((0.0, 1.0), (1.0, 1.0)),
    # peak 1.5 at pass rate 0.5, 1.0 at the extremes of the mixed range, 0.5 once (nearly) solved
    "mixed_up": ((0.0, 1.0), (0.5, 1.5), (0.875, 1.0), (1.0, 0.5)),
    # keep hard prompts at 1, decay linearly from pass rate 0.5 to 0.25 at 1
    "solved_down": ((0.0, 1.0), (0.5, 1.0), (1.0, 0.25)),
}


@dataclass(frozen=True)
class DifficultyCurve:
    """A piecewise-linear multiplier ``g(pass_rate)`` on [0, 1].

    ``points`` are ``(pass_rate, scale)`` pairs with strictly increasing pass rates covering 0 and 1;
    between points the scale is interpolated linearly. Build from a preset name or a list in YAML with
    :meth:`from_config`.
    """

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        pts = tuple((float(x), float(y)) for x, y in self.points)
        xs = [x for x, _ in pts]
        if len(pts) < 2 or xs[0] != 0.0 or xs[-1] != 1.0 or any(b <= a for a, b in zip(xs, xs[1:])):
            raise KeyeConfigError(
                f"difficulty curve needs >= 2 points with strictly increasing pass rates from 0 to 1, got {pts}"
            )
        if any(y < 0 or y != y for _, y in pts):
            raise KeyeConfigError(f"difficulty curve scales must be finite and >= 0, got {pts}")
        object.__setattr__(self, "points", pts)

    @classmethod
    def from_config(cls, value: str | Sequence[Sequence[float]] | DifficultyCurve) -> DifficultyCurve:
        """A preset name (see ``DIFFICULTY_PRESETS``), a list of ``[pass_rate, scale]`` pairs, or a curve."""
        if isinstance(value, DifficultyCurve):
            return value
        if isinstance(value, str):
            if value not in DIFFICULTY_PRESETS:
                raise KeyeConfigError(f"unknown difficulty preset {value!r}; known: {sorted(DIFFICULTY_PRESETS)}")
            return cls(DIFFICULTY_PRESETS[value])
        try:
            return cls(tuple((float(x), float(y)) for x, y in value))
        except (TypeError, ValueError) as err:
            raise KeyeConfigError(f"difficulty curve must be a preset name or [[pass_rate, scale], ...]: {err}") from None

    def __call__(self, pass_rate: torch.Tensor) -> torch.Tensor:
        """Scale for each pass rate (float tensor with values in [0, 1]); same shape and dtype."""
        xs = torch.tensor([x for x, _ in self.points], dtype=torch.float64, device=pass_rate.device)
        ys = torch.tensor([y for _, y in self.points], dtype=torch.float64, device=pass_rate.device)
        p = pass_rate.double().clamp(0.0, 1.0)
        seg = torch.searchsorted(xs, p, right=True).clamp(1, len(xs) - 1)
        x0, x1, y0, y1 = xs[seg - 1], xs[seg], ys[seg - 1], ys[seg]
        return (y0 + (p - x0) / (x1 - x0) * (y1 - y0)).to(pass_rate.dtype)


def group_pass_rate(passed: torch.Tensor, group_ids: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """Fraction of counted members of each sample's group that passed, gathered per sample.

    Args:
        passed: bool [B] (e.g. accuracy part == 1). group_ids: int [B].
        counted: bool [B] rows that enter the rate (default all). Use the *fresh* rollouts only, so the
            rate measures the current policy and not the replayed successes. A group with no counted
            member gets rate 0.
    Returns:
        float32 [B] pass rate in [0, 1].
    """
    counted = torch.ones_like(passed, dtype=torch.bool) if counted is None else counted.bool()
    _check_flat(passed.float(), group_ids, counted)
    n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    idx = group_ids.long()
    num = torch.zeros(n_groups, dtype=torch.float64, device=passed.device).index_add_(
        0, idx, (passed.bool() & counted).double()
    )
    den = torch.zeros_like(num).index_add_(0, idx, counted.double())
    return (num / den.clamp(min=1))[idx].float()


def difficulty_reshape(
    advantages: torch.Tensor,
    passed: torch.Tensor,
    group_ids: torch.Tensor,
    curve: DifficultyCurve | str | Sequence[Sequence[float]],
    counted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multiply each sample's advantage by ``curve(pass rate of its group)``.

    Args:
        advantages: float [B] (already group-normalised). passed, group_ids, counted: as in
            :func:`group_pass_rate`. curve: a :class:`DifficultyCurve`, preset name or point list.
    Returns:
        (reshaped advantages [B], per-sample scale [B]).
    """
    curve = DifficultyCurve.from_config(curve)
    rate = group_pass_rate(passed, group_ids, counted)
    scale = curve(rate).to(advantages.dtype)
    return advantages * scale, scale
