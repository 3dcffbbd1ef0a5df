"""Difficulty-aware batch construction: DAPO dynamic sampling, prompt filtering, thinking-mode mix,
and group-preserving mini-batches.

- :func:`dynamic_sample` (DAPO): drop groups whose rewards are all equal (zero advantage, no signal) and
  keep drawing prompts until the batch holds ``target`` informative groups, at most ``max_rounds`` rounds.
  :func:`group_signal` picks what "equal" is measured on: the accuracy (DAPO: a group that is all wrong
  or all right is dropped even when a format reward varies) or the total reward.
- :func:`filter_prompts` (Keye-VL 1.5 §4.4.3, training.md §8.14): keep prompts whose sampling accuracy
  under the current model is strictly inside ``(low, high)`` = (0, 1) by default.
- :class:`ModeMix` (Keye mix-mode RL, training.md §2.3 II.2, §8.9): give each prompt a thinking mode
  (``/think``, ``/no_think`` appended to the last user text, or ``auto`` = no switch) in configured
  proportions. Neither Keye report publishes the proportions; the default is equal thirds [our choice].
- :func:`group_minibatches`: PPO mini-batches that never split a group (training.md §8.3).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.rollout.samples import RLPrompt, RolloutEngine

G = TypeVar("G")


def is_informative(rewards: Sequence[float], atol: float = 0.0) -> bool:
    """True when the rewards are not all equal (``max - min > atol``); an empty or single reward is not."""
    vals = [float(r) for r in rewards]
    return len(vals) > 1 and max(vals) - min(vals) > atol


DYNAMIC_SAMPLING_METRICS = ("accuracy", "reward")


def group_signal(group: Sequence[Any], metric: str = "accuracy") -> list[float]:
    """The values dynamic sampling compares within a group, one per valid member (missing replay rows skipped).

    ``"accuracy"`` (DAPO): 1.0 / 0.0 from each sample's ``passed`` (the verified success of
    :class:`keye.rl.rollout.scoring.RewardScorer`: the accuracy part reached ``pass_value``). ``"reward"``: the total
    ``reward`` (format, length and other parts included).

    Raises:
        KeyeConfigError: unknown ``metric``. KeyeInputError: a valid member that was not scored.
    """
    if metric not in DYNAMIC_SAMPLING_METRICS:
        raise KeyeConfigError(f"dynamic sampling metric must be one of {DYNAMIC_SAMPLING_METRICS}, got {metric!r}")
    field_name = "passed" if metric == "accuracy" else "reward"
    out = []
    for i, s in enumerate(group):
        if not getattr(s, "valid", True):
            continue
        value = getattr(s, field_name)
        if value is None:
            raise KeyeInputError(f"group member has no {field_name!r}; score the samples first", item=i)
        out.append(float(value))
    return out


@dataclass
class DynamicSamplingResult(Generic[G]):
    """``groups``: exactly ``target`` informative groups in draw order (fewer only if ``full`` is False);
    ``rounds``: generation rounds used; ``generated`` / ``dropped``: groups produced / discarded as
    uninformative; ``surplus``: informative groups beyond ``target`` that were discarded; ``exhausted``:
    the prompt source ran dry."""

    groups: list[G]
    rounds: int
    generated: int
    dropped: int
    surplus: int
    full: bool
    exhausted: bool

    def stats(self, prefix: str = "dynsample/") -> dict[str, float]:
        """Floats for logging."""
        return {f"{prefix}rounds": float(self.rounds), f"{prefix}generated": float(self.generated),
                f"{prefix}dropped": float(self.dropped), f"{prefix}kept_frac":
                (self.generated - self.dropped) / self.generated if self.generated else 0.0}


def dynamic_sample(
    draw: Callable[[int], Sequence[Any]],
    produce: Callable[[Sequence[Any]], Sequence[G]],
    target: int,
    *,
    rewards_of: Callable[[G], Sequence[float]] = lambda g: g.rewards,  # type: ignore[attr-defined]
    max_rounds: int = 8,
    oversample: float = 1.0,
    atol: float = 0.0,
    strict: bool = False,
) -> DynamicSamplingResult[G]:
    """DAPO dynamic sampling.

    Args:
        draw: ``draw(k)`` returns up to ``k`` new prompts (fewer or none when the source is exhausted).
        produce: rolls out and scores prompts, returning one group per prompt (fresh + replay members).
        target: informative groups wanted. rewards_of: the values compared within a group (e.g.
            ``lambda g: group_signal(g, "accuracy")``).
        max_rounds: at most this many ``produce`` calls. oversample: round ``k > 1`` draws
            ``ceil(missing * oversample)`` prompts (round 1 draws ``ceil(target * oversample)``).
        atol: rewards closer than this count as equal. strict: raise instead of returning a short batch.
    Returns:
        :class:`DynamicSamplingResult`.
    Raises:
        KeyeInputError: with ``strict`` when ``target`` groups could not be filled.
    """
    if target < 1 or max_rounds < 1 or oversample < 1.0:
        raise KeyeConfigError(f"need target >= 1, max_rounds >= 1, oversample >= 1; got {target}, {max_rounds}, {oversample}")
    kept: list[G] = []
    generated = dropped = surplus = rounds = 0
    exhausted = False
    while len(kept) < target and rounds < max_rounds:
        want = math.ceil((target - len(kept)) * oversample)
        prompts = list(draw(want))
        if not prompts:
            exhausted = True
            break
        rounds += 1
        groups = list(produce(prompts))
        if len(groups) != len(prompts):
            raise KeyeInputError(f"produce returned {len(groups)} groups for {len(prompts)} prompts")
        generated += len(groups)
        for g in groups:
            if not is_informative(rewards_of(g), atol):
                dropped += 1
            elif len(kept) < target:
                kept.append(g)
            else:
                surplus += 1
        if len(prompts) < want:
            exhausted = True
            break
    full = len(kept) == target
    if strict and not full:
        raise KeyeInputError(
            f"dynamic sampling filled {len(kept)} of {target} groups in {rounds} rounds "
            f"({dropped} of {generated} groups had equal rewards{'; prompt source exhausted' if exhausted else ''})"
        )
    return DynamicSamplingResult(kept, rounds, generated, dropped, surplus, full, exhausted)


@dataclass
class PromptFilterResult:
    """``kept`` prompts (input order), ``pass_rates`` by prompt id for every prompt evaluated."""

    kept: list[RLPrompt]
    pass_rates: dict[str, float] = field(default_factory=dict)


def filter_prompts(
    prompts: Sequence[RLPrompt],
    engine: RolloutEngine,
    scorer: Callable[[Sequence[Any]], Any],
    n: int,
    *,
    low: float = 0.0,
    high: float = 1.0,
    batch_prompts: int = 8,
) -> PromptFilterResult:
    """Keep prompts whose sampling accuracy (fraction of ``n`` samples with ``passed``) is in ``(low, high)``.

    ``scorer(samples)`` returns an object with a ``passed`` list (see :class:`keye.rl.rollout.scoring.RewardScorer`).
    """
    if n < 1 or batch_prompts < 1 or not 0.0 <= low < high <= 1.0:
        raise KeyeConfigError(f"need n >= 1, batch_prompts >= 1 and 0 <= low < high <= 1; got {n}, {batch_prompts}, {low}, {high}")
    rates: dict[str, float] = {}
    kept: list[RLPrompt] = []
    for s in range(0, len(prompts), batch_prompts):
        chunk = list(prompts[s : s + batch_prompts])
        samples = engine.generate(chunk, n)
        passed = scorer(samples).passed
        for i, p in enumerate(chunk):
            flags = [ok for smp, ok in zip(samples, passed) if smp.group == i]
            rate = sum(bool(x) for x in flags) / max(len(flags), 1)
            rates[p.id] = rate
            if low < rate < high:
                kept.append(p)
    return PromptFilterResult(kept, rates)


MODE_NAMES = ("think", "no_think", "auto")


@dataclass
class ModeMix:
    """Proportions of thinking modes over a batch's prompts (normalised; zeros allowed, sum > 0).

    ``assign`` gives exactly ``round``-ed counts per mode by largest remainder (ties in mode order), then
    shuffles them with ``rng``: deterministic for a seeded RNG. Every rollout of a prompt shares its mode,
    so a GRPO group compares answers to one prompt text.
    """

    think: float = 1.0
    no_think: float = 1.0
    auto: float = 1.0

    def __post_init__(self) -> None:
        w = [self.think, self.no_think, self.auto]
        if any(x < 0 or x != x for x in w) or sum(w) <= 0:
            raise KeyeConfigError(f"mode proportions must be >= 0 with a positive sum, got {w}")

    @classmethod
    def from_config(cls, value: dict[str, float] | ModeMix | None) -> ModeMix | None:
        """A dict like ``{think: 0.5, no_think: 0.3, auto: 0.2}`` (missing modes = 0), a ModeMix or None."""
        if value is None or isinstance(value, ModeMix):
            return value
        unknown = set(value) - set(MODE_NAMES)
        if unknown:
            raise KeyeConfigError(f"unknown thinking modes {sorted(unknown)}; known: {MODE_NAMES}")
        return cls(**{m: float(value.get(m, 0.0)) for m in MODE_NAMES})

    def counts(self, n: int) -> dict[str, int]:
        """Per-mode counts summing to ``n`` (largest-remainder rounding of the proportions)."""
        w = [self.think, self.no_think, self.auto]
        total = sum(w)
        raw = [n * x / total for x in w]
        base = [math.floor(r) for r in raw]
        order = sorted(range(3), key=lambda i: (-(raw[i] - base[i]), i))
        for i in order[: n - sum(base)]:
            base[i] += 1
        return dict(zip(MODE_NAMES, base))

    def assign(self, prompts: Sequence[RLPrompt], rng: random.Random) -> list[RLPrompt]:
        """Copies of ``prompts`` with ``mode`` set (the prompts themselves are not modified)."""
        modes = [m for m, c in self.counts(len(prompts)).items() for _ in range(c)]
        rng.shuffle(modes)
        return [dataclasses.replace(p, mode=m) for p, m in zip(prompts, modes)]


def group_minibatches(
    group_ids: torch.Tensor, groups_per_minibatch: int, *, shuffle: bool = True,
    generator: torch.Generator | None = None,
) -> list[torch.Tensor]:
    """Split sample indices into PPO mini-batches of whole groups.

    Args:
        group_ids: int [B] group id of every sample. groups_per_minibatch: groups per mini-batch (the
            last one may hold fewer). shuffle: permute the groups first (with ``generator``).
    Returns:
        list of int64 index tensors into the batch; each group's members are all in one of them, in
        their original relative order.
    """
    if groups_per_minibatch < 1:
        raise KeyeConfigError(f"groups_per_minibatch must be >= 1, got {groups_per_minibatch}")
    uniq = torch.unique(group_ids)
    if shuffle:
        uniq = uniq[torch.randperm(len(uniq), generator=generator)]
    out = []
    for s in range(0, len(uniq), groups_per_minibatch):
        chosen = uniq[s : s + groups_per_minibatch]
        out.append(torch.nonzero(torch.isin(group_ids, chosen)).squeeze(1))
    return out
