"""The sampling settings of an RL run, built once from ``rollout`` and handed to every engine and the learner.

The learner's log-probs must be those of the distribution the engine sampled from (the same temperature), so a
builder that copied the fields one by one and forgot one would make the learner and the sampler silently disagree.
Every engine (in-process, vLLM, Ray rollout workers, streaming workers) and the learner take this one object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keye.errors import KeyeConfigError


@dataclass(frozen=True)
class SamplingSettings:
    """How fresh responses are sampled.

    Args:
        max_new_tokens: sampled tokens per response at most (a forced ``response_prefix`` is not counted).
        temperature: softmax temperature (> 0: rollouts sample); the learner's log-probs use it too.
        top_p, top_k: nucleus / top-k filtering (1.0 / 0: off, the policy's own distribution as RLEP uses).
        max_batch_size: sequences an in-process engine decodes together.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_batch_size: int = 64

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise KeyeConfigError(f"temperature must be > 0 for sampling rollouts, got {self.temperature}")
        if self.max_batch_size < 1:
            raise KeyeConfigError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_new_tokens < 1:
            raise KeyeConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @classmethod
    def from_config(cls, rollout: Any) -> SamplingSettings:
        """The settings of a ``rollout`` config section (:class:`keye.rl.config.RolloutSection`)."""
        return cls(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p,
                   top_k=rollout.top_k, max_batch_size=rollout.max_batch_size)


__all__ = ["SamplingSettings"]
