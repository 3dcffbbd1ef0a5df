"""Rule-based rewards for Keye-style outputs: format, thinking modes, instructions, repetition, accuracy.

Usage::

    from keye.rewards import RewardSpec, score, score_batch, aggregate_stats
    spec = RewardSpec(format=1.0, accuracy=1.0, repetition=0.5)          # or RewardSpec.from_yaml(path)
    r = score(response, reference="12", task="numeric", mode="think", spec=spec)
    r.total, r.parts                                                      # float, {"format": 1.0, ...}

Parts and their ranges (``total = sum(weight * part)`` over the parts that apply to a sample; a part that
does not apply -- accuracy without a reference, an instruction the sample does not ask for -- is absent from
``parts`` and adds nothing):

============  ===========  ==========================================================================
part          range        rule (details in the module named)
============  ===========  ==========================================================================
format        {0, 1}       tags once, in order, closed, nothing after ``</answer>``; requested mode
                           (think / no_think / auto) matches the mode used (``keye.rewards.format``)
accuracy      {0, 1}       final answer correct for the task: mc, numeric, math (math-verify with a hard
                           timeout), text, list, json (``keye.rewards.accuracy``); {-1, +1} with
                           ``RewardSpec(accuracy_pm1=True)`` (RLEP's verifier)
json          {0, 1}       visible answer is a JSON object/array, valid against an optional JSON schema
code          {0, 1}       a closed fenced block of the requested language that parses (python/json)
markdown      {0, 1}       a markdown list (>= N items) or table, as requested
steps         {0, 1}       number of reasoning steps inside the requested window
length        {0, 1}       answer word count inside the requested window (``keye.rewards.instruct``)
repetition    [-1, 0]      minus the worst of repeated n-grams / repeated lines / trailing loop share
overlong      [-1, 0]      DAPO soft overlong penalty (``keye.rewards.repetition``)
custom        [low, high]  rewards added with ``@register_reward(name, low=..., high=...)``
============  ===========  ==========================================================================

Every part is finite and inside its range for any response string (empty, megabytes long, deeply nested,
unbalanced tags, any Unicode, NUL bytes); all parsing is linear-time or capped, and math equivalence runs in
a killable worker process with ``RewardSpec.math_timeout_s`` as a hard limit, so a reward call never hangs.
Configuration errors raise ``KeyeConfigError``; bad call arguments (unknown task/mode, malformed extras)
raise ``KeyeInputError``.
"""

from __future__ import annotations

from keye.rewards import builtins as _builtins  # noqa: F401 - registers the built-in parts
from keye.rewards.format import check_format, mode_from_prompt, parse_structure
from keye.rewards.mathverify import MathVerifier, get_verifier
from keye.rewards.registry import RewardContext, RewardInfo, get_reward, known_rewards, register_reward
from keye.rewards.scoring import RewardResult, aggregate_stats, score, score_batch
from keye.rewards.spec import BUILTIN_PARTS, RewardSpec
from keye.rewards.text import final_answer

__all__ = [
    "BUILTIN_PARTS",
    "MathVerifier",
    "RewardContext",
    "RewardInfo",
    "RewardResult",
    "RewardSpec",
    "aggregate_stats",
    "check_format",
    "final_answer",
    "get_reward",
    "get_verifier",
    "known_rewards",
    "mode_from_prompt",
    "parse_structure",
    "register_reward",
    "score",
    "score_batch",
]
