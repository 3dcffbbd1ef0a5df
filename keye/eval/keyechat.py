"""Keye's evaluation wrapper (``KeyeChat`` in the vendored VLMEvalKit) as benchmark glue: its response
post-processing and its thinking-mode switch, applied to benchmark conversations.

The rules themselves live with the other answer-format helpers: the post-processing is
:func:`keye.rewards.text.final_answer` (``docs/evaluation.md`` section 3: text after the last ``</analysis>``,
then after the last ``</think>``, then the last ``<answer>`` block and the boxed extraction
:func:`keye.rewards.text.extract_boxed`), and the switch is :func:`keye.processing.chat.apply_mode` with
:func:`keye.rewards.format.mode_suffix` (``/think`` or ``/no_think`` appended with no space to the last text
item of the last user message; auto adds nothing).
"""

from __future__ import annotations

import copy
from typing import Any

from keye.errors import KeyeInputError
from keye.rewards.format import MODES, mode_suffix
from keye.rewards.text import extract_boxed, final_answer

__all__ = ["MODES", "add_mode_suffix", "extract_boxed", "mode_suffix", "post_process"]


def post_process(text: str) -> str:
    """Apply Keye's evaluation post-processing to one raw generation and return the prediction string.

    The rules are :func:`keye.rewards.text.final_answer`'s. ``text`` must be a ``str`` (``KeyeInputError``
    otherwise: a benchmark record with no generation is a bug upstream, not an empty answer).
    """
    if not isinstance(text, str):
        raise KeyeInputError(f"model output must be a string, got {type(text).__name__}")
    return final_answer(text)


def add_mode_suffix(conversation: list[dict[str, Any]], mode: str | None) -> list[dict[str, Any]]:
    """Return a deep copy of ``conversation`` with Keye's mode switch on the last user text.

    ``conversation`` is a list of ``{"role", "content"}`` messages in the qwen-vl-utils schema, ``content``
    being a string or a list of ``{"type": "text"|"image"|"video", ...}`` items. The switch (``/think`` or
    ``/no_think``, nothing for auto or None) replaces any switch already at the end of the last text item of
    the last user message (:func:`keye.processing.chat.apply_mode`); a user message with no text item gets a
    new text item holding only the switch. This is for engines that take the prompt as text (a served
    model); :class:`keye.eval.runner.KeyeEngine` passes the mode to the processor instead. Raises
    ``KeyeInputError`` for an unknown mode or, when there is a switch to add, no user message or one whose
    content is neither a string nor a list.
    """
    # Imported here: the processing package loads torch, and the runner imports this module for post_process.
    from keye.processing.chat import apply_mode

    suffix = mode_suffix(mode)
    conv = copy.deepcopy(conversation)
    if not suffix:
        return conv
    users = [m for m in conv if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise KeyeInputError("conversation has no user message to carry the thinking-mode switch")
    if not isinstance(users[-1].get("content"), (str, list)):
        raise KeyeInputError("user message content must be a string or a list of items")
    return apply_mode(conv, mode)
