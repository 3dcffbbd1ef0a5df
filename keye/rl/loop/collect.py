"""RLEP phase A (``keye rlep collect``): sample ``n`` answers per question from a seed policy and keep the
questions with enough distinct verified answers, as the replay pool (:class:`keye.rl.algorithms.replay.ReplayPool`)
phase B replays."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.algorithms.replay import ReplayEntry, ReplayPool
from keye.rl.rollout.samples import RLPrompt, RolloutEngine, RolloutSample
from keye.rl.rollout.settings import SamplingSettings


# ------------------------------------------------------------------------------------------ phase A
@dataclass
class CollectStats:
    """What :func:`collect` did: questions seen / kept, candidates sampled, successes, mean pass rate."""

    questions: int = 0
    kept: int = 0
    candidates: int = 0
    successes: int = 0
    pass_rate_sum: float = 0.0

    @property
    def mean_pass_rate(self) -> float:
        """Mean over questions of the fraction of candidates that passed."""
        return self.pass_rate_sum / self.questions if self.questions else 0.0


def collect(
    engine: RolloutEngine,
    prompts: Iterable[RLPrompt],
    n: int,
    scorer: Callable[[Sequence[RolloutSample]], Any],
    *,
    min_successes: int = 2,
    batch_prompts: int = 8,
    pool: ReplayPool | None = None,
    progress: Callable[[CollectStats], None] | None = None,
) -> tuple[ReplayPool, CollectStats]:
    """Phase A: sample ``n`` answers per prompt, keep verified successes, drop thin questions.

    Args:
        engine: any :class:`~keye.rl.rollout.samples.RolloutEngine` (RLEP: the 400-step baseline policy,
            temperature 0.7, top-p 0.95, n = 64).
        prompts: the training questions (ids must be unique).
        scorer: returns an object with ``rewards`` and ``passed`` lists (e.g. :class:`keye.rl.rollout.scoring.RewardScorer`).
        min_successes: a question enters the pool only with at least this many *distinct* successes.
        batch_prompts: prompts per ``engine.generate`` call.
        pool: add to this pool (default: a new unbounded one).
        progress: called with the running stats after each batch.
    Returns:
        (pool, stats).
    """
    if n < 1 or min_successes < 1 or batch_prompts < 1:
        raise KeyeConfigError(f"need n >= 1, min_successes >= 1, batch_prompts >= 1; got {n}, {min_successes}, {batch_prompts}")
    pool = pool if pool is not None else ReplayPool()
    stats = CollectStats()
    seen: set[str] = set()
    buf: list[RLPrompt] = []

    def _flush() -> None:
        samples = engine.generate(buf, n)
        scores = scorer(samples)
        for i, p in enumerate(buf):
            group = [(s, ok, r) for s, ok, r in zip(samples, scores.passed, scores.rewards) if s.group == i]
            stats.questions += 1
            stats.candidates += len(group)
            ok_rows = [(s, r) for s, ok, r in group if ok]
            stats.successes += len(ok_rows)
            stats.pass_rate_sum += len(ok_rows) / max(len(group), 1)
            entries, keys = [], set()
            for s, r in ok_rows:
                e = ReplayEntry(p.id, s.text, [int(t) for t in s.response_ids], float(r),
                                {"mode": p.mode, "source": "collect"})
                if e.key() not in keys:
                    keys.add(e.key())
                    entries.append(e)
            if len(entries) >= min_successes:
                stats.kept += 1
                for e in entries:
                    pool.add(e)
        buf.clear()
        if progress is not None:
            progress(stats)

    for p in prompts:
        if p.id in seen:
            raise KeyeInputError(f"duplicate question id {p.id!r}")
        seen.add(p.id)
        buf.append(p)
        if len(buf) == batch_prompts:
            _flush()
    if buf:
        _flush()
    return pool, stats


def collect_to_file(
    policy: str | Path,
    data: str | Path,
    out: str | Path,
    *,
    n: int = 64,
    temperature: float = 0.7,
    top_p: float = 0.95,
    max_new_tokens: int = 3072,
    min_successes: int = 2,
    reward: Any = None,
    scorer: Callable[[Sequence[RolloutSample]], Any] | None = None,
    engine: str = "local",
    batch_prompts: int = 8,
    max_batch_size: int = 64,
    seed: int = 0,
    device: str | None = None,
    torch_dtype: str = "auto",
    progress: Callable[[CollectStats], None] | None = None,
) -> CollectStats:
    """``keye rlep collect``: phase A from a checkpoint directory and an RL manifest to a pool JSONL.

    Args:
        policy: checkpoint directory (weights + processor files) of the seed policy, a hub id, or
            ``keye-tiny`` (the embedded default).
        data: RL manifest (see :func:`keye.rl.rollout.prompts.load_rl_prompts`). out: pool JSONL path.
        n, temperature, top_p, max_new_tokens: sampling (RLEP: 64, 0.7, 0.95, 3072).
        reward: a :class:`keye.rewards.RewardSpec`, a YAML path or None (default spec); ignored when a
            ``scorer`` is given.
        engine: ``"local"`` (:class:`LocalRollout`) or ``"vllm"`` (:class:`VLLMRollout`).
    Returns:
        the :class:`CollectStats`; the pool is written to ``out``.
    """
    from keye.processing.processor import KeyeProcessor
    from keye.rl.rollout.engines import LocalRollout, VLLMRollout
    from keye.rl.rollout.prompts import load_rl_prompts
    from keye.rl.rollout.scoring import RewardScorer
    from keye.tiny import resolve_model_path

    policy = resolve_model_path(policy)
    prompts = load_rl_prompts(data)
    processor = KeyeProcessor.from_pretrained(policy)
    sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                max_batch_size=max_batch_size)
    if engine == "local":
        from keye.model.keye_vl import KeyeVL

        model = KeyeVL.from_pretrained(policy, torch_dtype=torch_dtype, device=device)
        rollout: RolloutEngine = LocalRollout(model, processor, sampling, seed=seed)
    elif engine == "vllm":
        rollout = VLLMRollout(str(policy), processor, sampling, seed=seed)
    else:
        raise KeyeConfigError(f"engine must be 'local' or 'vllm', got {engine!r}")
    if scorer is None:
        if isinstance(reward, (str, Path)):
            from keye.rewards import RewardSpec

            reward = RewardSpec.from_yaml(reward)
        scorer = RewardScorer(reward)
    pool, stats = collect(rollout, prompts, n, scorer, min_successes=min_successes, batch_prompts=batch_prompts,
                          progress=progress)
    pool.save_jsonl(out)
    return stats
