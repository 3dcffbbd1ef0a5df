"""Scoring rollout samples with the rule-based reward module (``keye.rewards``) by name in a config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from keye.rl.rollout.samples import RolloutSample


@dataclass
class Scores:
    """Rewards of a list of samples: ``rewards`` (scalar used for advantages), ``passed`` (verified
    success: the pool's and the pass rate's notion), ``parts`` (reward parts for logging)."""

    rewards: list[float]
    passed: list[bool]
    parts: list[dict[str, float]] = field(default_factory=list)


class Scorer(Protocol):
    """Anything that scores samples: ``scorer(samples) -> Scores`` (same order, same length)."""

    def __call__(self, samples: Sequence[RolloutSample]) -> Scores: ...


class RewardScorer:
    """Scores samples with :func:`keye.rewards.score_batch` (the same function for fresh and replayed text).

    Each sample is scored against its prompt's ``reference``/``task``, in the prompt's requested ``mode``,
    with the prompt's ``extra`` columns and ``num_tokens`` = response length (for the overlong part).

    ``passed`` is ``accuracy part >= pass_value`` when the accuracy part applied (1 for the {0, 1} and
    {-1, +1} verifiers), else ``total >= pass_threshold``.

    Args:
        spec: a :class:`keye.rewards.RewardSpec`, a dict of part weights, or None (the default spec).
    """

    def __init__(self, spec: Any = None, *, pass_value: float = 1.0, pass_threshold: float = 1.0):
        from keye.rewards import RewardSpec

        if isinstance(spec, dict):
            spec = RewardSpec(**spec)
        self.spec = spec if spec is not None else RewardSpec()
        self.pass_value = pass_value
        self.pass_threshold = pass_threshold

    @classmethod
    def from_config(cls, reward: Any, *, accuracy_only: bool = False) -> RewardScorer:
        """The scorer of a ``reward`` config section (:class:`keye.rl.config.RewardSection`: a
        :meth:`keye.rewards.RewardSpec.from_dict` mapping and ``pass_value``). ``accuracy_only``: the accuracy
        part alone with the same answer-checking options (held-out evaluation and prompt filtering score so)."""
        from keye.rewards import RewardSpec

        spec = dict(reward.spec)
        if accuracy_only:
            options = dict(spec.get("options") or {})
            options.update({k: v for k, v in spec.items() if k not in ("rewards", "options")})
            spec = {"rewards": ["accuracy"], "options": options}
        return cls(RewardSpec.from_dict(spec), pass_value=reward.pass_value)

    def __call__(self, samples: Sequence[RolloutSample]) -> Scores:
        """Score every sample; invalid (missing replay) samples get reward 0 and passed False."""
        from keye.rewards import score

        rewards, passed, parts = [], [], []
        for s in samples:
            if not s.valid:
                rewards.append(0.0)
                passed.append(False)
                parts.append({})
                continue
            p = s.prompt
            extra = dict(p.extra)
            extra.setdefault("num_tokens", int(s.response_ids.numel()))
            r = score(s.text, p.reference, p.task, p.mode, self.spec, **extra)
            rewards.append(r.total)
            acc = r.parts.get("accuracy")
            passed.append(acc >= self.pass_value if acc is not None else r.total >= self.pass_threshold)
            parts.append(dict(r.parts))
        return Scores(rewards, passed, parts)
