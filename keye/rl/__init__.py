"""Reinforcement learning for Keye-VL: GRPO-family losses, RLEP replay, difficulty-aware sampling, rollouts.

The package is grouped by role (docs/architecture.md, "Training layers"); each sub-package imports only the ones
listed before it:

- ``rollout/``: the sample records and their batching (:class:`RLPrompt`, :class:`PromptInputs`,
  :class:`RolloutSample`, :func:`split_batch`, :func:`collate_prompts`, :func:`collate_samples`), response masks,
  prompts from a manifest (:func:`load_rl_prompts`), the sampling settings, the engines (:class:`LocalRollout`,
  :class:`VLLMRollout`) and reward scoring (:class:`RewardScorer`, :class:`Scores`);
- ``algorithms/``: advantages (:func:`group_advantages`, :func:`rlep_advantages`, :class:`DifficultyCurve`, ...),
  the policy loss (:func:`policy_loss`, :func:`aggregate`, :func:`kl_penalty`), dynamic sampling and mode mixes
  (:func:`dynamic_sample`, :func:`filter_prompts`, :class:`ModeMix`, :func:`group_minibatches`), the replay pool
  (:class:`ReplayPool`, :func:`add_replay`), AutoThink, and the reference update path (:func:`set_scores`,
  :func:`assign_advantages`, :func:`fill_logprobs`, :func:`accumulate_policy_gradients`);
- ``learner/``: the learner (policy, reference, optimizer; replicated or sharded) and the memory planner;
- ``loop/``: the pieces of the one RL loop (components, batch source, state, evaluation, metrics) and RLEP phase A
  (:func:`collect`, :func:`collect_to_file`: ``keye rlep collect``);
- ``distributed/``: the Ray runtime (learner group, rollout and reward workers, weight sync) and the
  asynchronous streaming batch source (imported only with ``rl.engine: ray``).

``config.py`` is the recipe's YAML schema; the recipe itself is :mod:`keye.recipes.rlep`. Shared-prefix trees and
chunked log-probs (:func:`token_logprobs`) live in the training floor (:mod:`keye.train.tree`,
:mod:`keye.train.logprobs`), which SFT uses too.
"""

from __future__ import annotations

from keye.rl.algorithms.advantages import (
    DIFFICULTY_PRESETS,
    DifficultyCurve,
    difficulty_reshape,
    group_advantages,
    group_pass_rate,
    group_stats,
    rlep_advantages,
)
from keye.rl.algorithms.losses import aggregate, kl_penalty, policy_loss
from keye.rl.algorithms.replay import ReplayEntry, ReplayPool, add_replay, replay_samples
from keye.rl.algorithms.sampling import (
    DynamicSamplingResult,
    ModeMix,
    dynamic_sample,
    filter_prompts,
    group_minibatches,
    is_informative,
)
from keye.rl.algorithms.update import (
    accumulate_policy_gradients,
    assign_advantages,
    fill_logprobs,
    set_scores,
)
from keye.rl.loop.collect import CollectStats, collect, collect_to_file
from keye.rl.rollout.engines import LocalRollout, VLLMRollout
from keye.rl.rollout.masks import lengths_to_mask, response_lengths, response_mask, split_response
from keye.rl.rollout.prompts import load_rl_prompts, prompt_from_sample
from keye.rl.rollout.samples import (
    PromptInputs,
    RLPrompt,
    RolloutEngine,
    RolloutSample,
    collate_prompts,
    collate_samples,
    split_batch,
)
from keye.rl.rollout.scoring import RewardScorer, Scores
from keye.rl.rollout.settings import SamplingSettings
from keye.train.logprobs import LogprobOutput, token_logprobs

__all__ = [
    "DIFFICULTY_PRESETS",
    "CollectStats",
    "DifficultyCurve",
    "DynamicSamplingResult",
    "LocalRollout",
    "LogprobOutput",
    "ModeMix",
    "PromptInputs",
    "RLPrompt",
    "ReplayEntry",
    "ReplayPool",
    "RewardScorer",
    "RolloutEngine",
    "RolloutSample",
    "SamplingSettings",
    "Scores",
    "VLLMRollout",
    "accumulate_policy_gradients",
    "add_replay",
    "aggregate",
    "assign_advantages",
    "collate_prompts",
    "collate_samples",
    "collect",
    "collect_to_file",
    "difficulty_reshape",
    "dynamic_sample",
    "fill_logprobs",
    "filter_prompts",
    "group_advantages",
    "group_minibatches",
    "group_pass_rate",
    "group_stats",
    "is_informative",
    "kl_penalty",
    "lengths_to_mask",
    "load_rl_prompts",
    "policy_loss",
    "prompt_from_sample",
    "replay_samples",
    "response_lengths",
    "response_mask",
    "rlep_advantages",
    "set_scores",
    "split_batch",
    "split_response",
    "token_logprobs",
]
