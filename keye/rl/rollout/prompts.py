"""RL prompts from a training manifest (``keye.data.manifest`` JSONL).

A manifest row becomes an :class:`~keye.rl.rollout.samples.RLPrompt`: the conversation up to and including the last
user turn (assistant answers are dropped: the policy writes its own), ``answer`` -> ``reference``,
``answer_kind`` -> ``task``, an optional ``mode`` (think / no_think / auto), and the reward extras found in
the row (``choices``, ``tolerance``, ``precision``, ``ordered``, ``instructions``).
"""

from __future__ import annotations

import os
from typing import Any

from keye.errors import KeyeInputError
from keye.rl.rollout.samples import RLPrompt

REWARD_EXTRAS = ("choices", "tolerance", "precision", "ordered", "instructions")


def prompt_from_sample(sample: Any) -> RLPrompt:
    """Convert one :class:`keye.data.manifest.Sample`; raises :class:`KeyeInputError` when it has no user turn."""
    messages = sample.messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise KeyeInputError("RL sample has no user turn", item=sample.id)
    row = sample.row
    extra = {k: row[k] for k in REWARD_EXTRAS if k in row}
    mode = row.get("mode")
    if mode not in (None, "think", "no_think", "auto"):
        raise KeyeInputError(f"unknown thinking mode {mode!r}", item=sample.id)
    return RLPrompt(str(sample.id), messages[: users[-1] + 1], reference=row.get("answer"),
                    task=row.get("answer_kind"), mode=mode, extra=extra)


def load_rl_prompts(path: str | os.PathLike[str], *, strict: bool = True) -> list[RLPrompt]:
    """Read a manifest into RL prompts (file order).

    Args:
        strict: raise on the first malformed row (with its line number) instead of skipping bad rows.
    Raises:
        KeyeInputError: unreadable file, malformed rows (``strict``), or rows without a user turn.
    """
    from keye.data.manifest import read_manifest

    manifest = read_manifest(path)
    if strict and manifest.bad_rows:
        raise KeyeInputError(str(manifest.bad_rows[0]), path=path, item=f"line {manifest.bad_rows[0].line}")
    return [prompt_from_sample(s) for s in manifest.samples]
