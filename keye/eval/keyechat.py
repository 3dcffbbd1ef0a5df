"""Keye's own response post-processing and thinking-mode switches, as its evaluation wrapper applies them.

The official Keye evaluation (``KeyeChat`` in the vendored VLMEvalKit) turns a raw generation into the
``prediction`` that the benchmark parsers see. The rules, from ``docs/evaluation.md`` section 3:

1. If ``</analysis>`` occurs (auto mode's mode-selection preamble), keep the text after its last occurrence.
2. If ``</think>`` occurs, keep the text after its last occurrence, drop leading newlines and trim.
3. Without ``<answer>``, return the boxed extraction of the text (see :func:`extract_boxed`).
4. With ``<answer>``: the last non-greedy ``<answer>...</answer>`` match (dot matches newlines) goes through the
   boxed extraction; an unclosed tag leaves the text unchanged, tag included.

Forced modes append ``/think`` or ``/no_think`` with no space to the last text item of the last user message;
auto mode adds nothing.
"""

from __future__ import annotations

import copy
from typing import Any

from keye.errors import KeyeInputError
from keye.rewards.text import last_answer_block

MODES = ("think", "no_think", "auto")
_MODE_SUFFIX = {"think": "/think", "no_think": "/no_think", "auto": ""}
_BOXED = "\\boxed{"


def extract_boxed(text: str) -> str:
    """Return the content of the last ``\\boxed{...}`` in ``text`` with nested braces kept.

    The scan starts after the last literal ``\\boxed{`` (or at the start of ``text`` when there is none) with a
    brace depth of 1 and stops just before the ``}`` that brings the depth to 0; with no such brace the rest
    of the text is kept. Like the original, text without any box but with an unbalanced ``}`` is cut at that
    brace (``"f(x)} = 3"`` -> ``"f(x)"``).
    """
    start = text.rfind(_BOXED)
    tail = text if start < 0 else text[start + len(_BOXED) :]
    depth = 1
    for i, ch in enumerate(tail):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return tail[:i]
    return tail


def post_process(text: str) -> str:
    """Apply Keye's evaluation post-processing to one raw generation and return the prediction string.

    See the module docstring for the exact rules. ``text`` must be a ``str`` (``KeyeInputError`` otherwise).
    """
    if not isinstance(text, str):
        raise KeyeInputError(f"model output must be a string, got {type(text).__name__}")
    if "</analysis>" in text:
        text = text[text.rfind("</analysis>") + len("</analysis>") :]
    if "</think>" in text:
        text = text[text.rfind("</think>") + len("</think>") :].lstrip("\n").strip()
    if "<answer>" not in text:
        return extract_boxed(text)
    # Last non-greedy <answer>...</answer> pair, found in linear time (a regex findall is quadratic on
    # many unclosed tags).
    last = last_answer_block(text)
    if last is None:
        return text
    return extract_boxed(last)


def mode_suffix(mode: str | None) -> str:
    """Return the text suffix of a thinking mode: ``/think``, ``/no_think`` or ``""`` for auto / None."""
    if mode is None:
        return ""
    if mode not in _MODE_SUFFIX:
        raise KeyeInputError(f"unknown thinking mode {mode!r}; expected one of {', '.join(MODES)}")
    return _MODE_SUFFIX[mode]


def add_mode_suffix(conversation: list[dict[str, Any]], mode: str | None) -> list[dict[str, Any]]:
    """Return a deep copy of ``conversation`` with Keye's mode switch appended to the last user text.

    ``conversation`` is a list of ``{"role", "content"}`` messages in the qwen-vl-utils schema, ``content``
    being a string or a list of ``{"type": "text"|"image"|"video", ...}`` items. The suffix (``/think`` or
    ``/no_think``, nothing for auto) is appended with no space to the last text item of the last user
    message; a user message with no text item gets a new text item holding only the suffix. This is for
    engines that take the prompt as text (a served model); :class:`keye.eval.runner.KeyeEngine` passes the
    mode to the processor instead. Raises ``KeyeInputError`` when there is no user message.
    """
    suffix = mode_suffix(mode)
    conv = copy.deepcopy(conversation)
    if not suffix:
        return conv
    users = [m for m in conv if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise KeyeInputError("conversation has no user message to carry the thinking-mode switch")
    last = users[-1]
    content = last.get("content")
    if isinstance(content, str):
        last["content"] = content + suffix
        return conv
    if not isinstance(content, list):
        raise KeyeInputError("user message content must be a string or a list of items")
    for part in reversed(content):
        if isinstance(part, dict) and part.get("type") == "text":
            part["text"] = str(part.get("text", "")) + suffix
            return conv
    content.append({"type": "text", "text": suffix})
    return conv
