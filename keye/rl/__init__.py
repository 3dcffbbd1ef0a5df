"""Reinforcement learning for Keye-VL: GRPO-family losses, RLEP replay, difficulty-aware sampling, rollouts.

Public pieces:

- advantages.py: :func:`group_advantages`, :func:`rlep_advantages`, :func:`group_stats`,
  :class:`DifficultyCurve`, :func:`group_pass_rate`, :func:`difficulty_reshape`;
- losses.py: :func:`policy_loss`, :func:`aggregate`, :func:`kl_penalty`;
- masks.py: :func:`response_mask`, :func:`response_lengths`, :func:`split_response`, :func:`lengths_to_mask`;
- logprobs.py: :func:`token_logprobs`, :class:`LogprobOutput`;
- rollout.py: :class:`RLPrompt`, :class:`PromptInputs`, :class:`RolloutSample`, :class:`RolloutEngine`,
  :class:`LocalRollout`, :class:`VLLMRollout`, :func:`split_batch`, :func:`collate_prompts`,
  :func:`collate_samples`;
- replay.py: :class:`ReplayPool`, :class:`ReplayEntry`, :func:`collect`, :func:`replay_samples`,
  :func:`add_replay`, :func:`collect_to_file` (``keye rlep collect``);
- data.py: :func:`load_rl_prompts`, :func:`prompt_from_sample` (RL prompts from a manifest);
- sampling.py: :func:`dynamic_sample`, :func:`filter_prompts`, :class:`ModeMix`, :func:`group_minibatches`;
- scoring.py: :class:`RewardScorer`, :class:`Scores`;
- update.py: :func:`set_scores`, :func:`assign_advantages`, :func:`fill_logprobs`,
  :func:`accumulate_policy_gradients`;
- tree.py / tree_attention.py: shared-prefix tree batches (import those modules directly).
- config.py, components.py, batch.py, state.py, evaluate.py, metrics.py: the pieces of the RL recipe
  (``keye train rlep``, :mod:`keye.train.rlep`; import those modules directly, docs/rl_learner.md).
"""

from __future__ import annotations

from keye.rl.advantages import (
    DIFFICULTY_PRESETS,
    DifficultyCurve,
    difficulty_reshape,
    group_advantages,
    group_pass_rate,
    group_stats,
    rlep_advantages,
)
from keye.rl.data import load_rl_prompts, prompt_from_sample
from keye.rl.logprobs import LogprobOutput, token_logprobs
from keye.rl.losses import aggregate, kl_penalty, policy_loss
from keye.rl.masks import lengths_to_mask, response_lengths, response_mask, split_response
from keye.rl.replay import (
    CollectStats,
    ReplayEntry,
    ReplayPool,
    add_replay,
    collect,
    collect_to_file,
    replay_samples,
)
from keye.rl.rollout import (
    LocalRollout,
    PromptInputs,
    RLPrompt,
    RolloutEngine,
    RolloutSample,
    VLLMRollout,
    collate_prompts,
    collate_samples,
    split_batch,
)
from keye.rl.sampling import (
    DynamicSamplingResult,
    ModeMix,
    dynamic_sample,
    filter_prompts,
    group_minibatches,
    is_informative,
)
from keye.rl.scoring import RewardScorer, Scores
from keye.rl.update import accumulate_policy_gradients, assign_advantages, fill_logprobs, set_scores

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
