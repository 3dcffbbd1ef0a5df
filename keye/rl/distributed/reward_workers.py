"""Reward workers on Ray: :class:`RewardActor` s each holding a :class:`~keye.rl.rollout.scoring.RewardScorer`,
driven by :class:`RemoteScorer` (contiguous slices in parallel; a slice whose worker died or hung past
``rl.ray.reward_timeout_s`` is re-run on a new worker: scoring is deterministic, so the result is the same)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from keye.errors import KeyeConfigError
from keye.rl.distributed.ray_session import RaySession, WorkerPool, split_even
from keye.rl.rollout.samples import PromptInputs, RolloutSample
from keye.rl.rollout.scoring import Scores

try:
    import ray
except ImportError as _err:  # pragma: no cover - depends on the installation
    raise KeyeConfigError(f"rl.engine=ray needs the 'ray' package (pip install 'keye[ray]'): {_err}") from None


def _slim(s: RolloutSample) -> RolloutSample:
    """What a reward worker needs of a sample: its text, prompt, response ids and validity (not the pixels
    of the prompt, nor the log-probs)."""
    return replace(s, inputs=PromptInputs(s.inputs.input_ids), rollout_logp=None, old_logp=None, ref_logp=None)


class RewardActor:
    """A reward worker: ``scorer_factory()`` (a :class:`~keye.rl.rollout.scoring.RewardScorer` in the recipe) in its
    own process."""

    def __init__(self, scorer_factory: Callable[[], Any]):
        self.scorer = scorer_factory()

    def pid(self) -> int:
        """This actor's process id."""
        return os.getpid()

    def score(self, samples: list[RolloutSample]) -> Scores:
        """Score ``samples`` (same order)."""
        return self.scorer(samples)


@dataclass
class RewardScorerFactory:
    """Builds the run's :class:`~keye.rl.rollout.scoring.RewardScorer` from its ``reward`` section inside a reward
    worker (picklable)."""

    reward: Any

    def __call__(self) -> Any:
        from keye.rl.rollout.scoring import RewardScorer

        return RewardScorer.from_config(self.reward)


class RemoteScorer:
    """Scores samples on ``rl.ray.reward_workers`` :class:`RewardActor` s (contiguous slices, in parallel);
    a slice whose worker died or took longer than ``timeout_s`` is re-run on a new worker (the scorer is
    deterministic, so the result is the same). Same contract as :class:`~keye.rl.rollout.scoring.RewardScorer`."""

    def __init__(self, session: RaySession, factory: Callable[[], Any], workers: int, timeout_s: float,
                 max_restarts: int):
        self.timeout_s = timeout_s

        def make(i: int, gen: int) -> Any:
            return session.start(RewardActor, "reward", i, f"keye-reward-{i}-{gen}", factory)

        self.pool = WorkerPool(session, "reward", workers, make, max_restarts)

    def __call__(self, samples: Sequence[RolloutSample]) -> Scores:
        """Scores of ``samples`` in order."""
        slim = [_slim(s) for s in samples]
        spans = {k: span for k, span in enumerate(split_even(len(slim), len(self.pool.workers))) if span[1] > span[0]}
        jobs = {k: (lambda w, lo=lo, hi=hi: w.score.remote(slim[lo:hi])) for k, (lo, hi) in spans.items()}
        results = self.pool.run(jobs, "score", timeout=self.timeout_s)
        out = Scores([], [], [])
        for k in sorted(spans):
            part = results[k]
            out.rewards += list(part.rewards)
            out.passed += list(part.passed)
            out.parts += list(part.parts)
        return out

    def pids(self) -> list[int]:
        """The workers' process ids."""
        return ray.get([w.pid.remote() for w in self.pool.workers])
