"""Chat template rendering, thinking modes, training-label spans and response parsing (architecture.md §11).

The template is the official ``chat_template.json`` (identical for the preview and 1.5), rendered with
jinja2 the way transformers does (sandboxed, ``trim_blocks``/``lstrip_blocks``). Each image renders as
``<|vision_start|><|image_pad|><|vision_end|>`` and each video as ``<|vision_start|><|video_pad|><|vision_end|>``;
the processor then expands the single pad into the item's real token run.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from keye.errors import KeyeInputError
from keye.rewards.format import mode_suffix, split_mode_switch
from keye.rewards.text import last_boxed

# The one boxed rule for parsed responses lives with the other answer-format helpers; kept under its old name.
extract_boxed = last_boxed

OFFICIAL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in "
    "messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
    "assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string "
    "%}{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if "
    "content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set image_count.value = "
    "image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: {% endif "
    "%}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content "
    "%}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: "
    "{% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% "
    "endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool")
MODES = (None, "think", "no_think", "auto")


def item_kind(content: dict[str, Any]) -> str:
    """Classify a content item as ``"image"``, ``"video"`` or ``"text"``, with the template's precedence.

    Raises :class:`KeyeInputError` for an item that is none of these.
    """
    kind = content.get("type")
    if kind == "image" or "image" in content or "image_url" in content:
        return "image"
    if kind == "video" or "video" in content:
        return "video"
    if "text" in content and kind in (None, "text"):
        return "text"
    raise KeyeInputError(f"unknown content type {kind!r} (keys {sorted(content)})", item=content.get("type"))


def validate_messages(messages: Any, conversation: int | None = None) -> list[dict[str, Any]]:
    """Check a conversation: a non-empty list of ``{"role", "content"}`` dicts whose content is a string
    or a list of content items (text / image / image_url / video). Returns it unchanged.

    Raises :class:`KeyeInputError` naming the message index for anything else.
    """
    where = "" if conversation is None else f"conversation {conversation}, "
    if not isinstance(messages, list) or not messages:
        raise KeyeInputError(f"{where}messages must be a non-empty list of dicts")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
            raise KeyeInputError(f"{where}message {i} must be a dict with 'role' and 'content'", item=i)
        if msg["role"] not in ROLES:
            raise KeyeInputError(f"{where}message {i} has unknown role {msg['role']!r}", item=i)
        content = msg["content"]
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise KeyeInputError(f"{where}message {i} content must be a string or a list of items", item=i)
        for j, c in enumerate(content):
            if not isinstance(c, dict):
                raise KeyeInputError(f"{where}message {i} item {j} must be a dict", item=f"{i}.{j}")
            try:
                item_kind(c)
            except KeyeInputError as err:
                raise KeyeInputError(f"{where}message {i} item {j}: {err.reason}", item=f"{i}.{j}") from None
    return messages


def edit_last_user_text(messages: list[dict[str, Any]], edit: Callable[[str], str]) -> list[dict[str, Any]]:
    """Return a copy of ``messages`` whose last user message has its last text replaced by ``edit(text)``.

    The text is the message's string content or its last text item; a message with only media items gets a
    new text item holding ``edit("")`` when that is non-empty. Only the edited message and its items are
    copied; without a user message the copy is unchanged. Raises :class:`KeyeInputError` for an item that
    is neither text nor media (:func:`item_kind`).
    """
    out = copy.copy(messages)
    users = [i for i, m in enumerate(out) if m["role"] == "user"]
    if not users:
        return out
    i = users[-1]
    msg = dict(out[i])
    if isinstance(msg["content"], str):
        msg["content"] = edit(msg["content"])
    else:
        content = [dict(c) for c in msg["content"]]
        texts = [j for j, c in enumerate(content) if item_kind(c) == "text"]
        if texts:
            c = content[texts[-1]]
            c["text"] = edit(c["text"])
        elif added := edit(""):
            content.append({"type": "text", "text": added})
        msg["content"] = content
    out[i] = msg
    return out


def apply_mode(messages: list[dict[str, Any]], mode: str | None) -> list[dict[str, Any]]:
    """Return a copy of ``messages`` with the thinking-mode switch applied (§11.4).

    ``"think"`` / ``"no_think"`` append ``/think`` / ``/no_think`` (no space) to the last text item of the
    last user message, replacing a switch already there; ``"auto"`` removes any switch; ``None`` leaves
    the messages untouched. Raises :class:`KeyeInputError` for an unknown mode.
    """
    suffix = mode_suffix(mode)
    if mode is None:
        return messages
    return edit_last_user_text(messages, lambda text: split_mode_switch(text)[0] + suffix)


class ChatTemplate:
    """A compiled chat template (jinja2, sandboxed, as transformers renders processor templates)."""

    def __init__(self, source: str = OFFICIAL_CHAT_TEMPLATE):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.source = source
        self._template = env.from_string(source)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, add_vision_id: bool = False
    ) -> str:
        """Render one conversation to the prompt string (placeholders not yet expanded)."""
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, add_vision_id=add_vision_id
        )


_ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?)(<\|im_end\|>|$)", re.DOTALL)


def assistant_spans(rendered: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the rendered prompt that training labels cover: the content of
    each assistant turn plus its closing ``<|im_end|>`` (not the ``<|im_start|>assistant\\n`` header, not
    the newline after ``<|im_end|>``). An empty generation prompt at the end yields no span."""
    spans = []
    for m in _ASSISTANT_TURN.finditer(rendered):
        start, end = m.start(1), m.end(2)
        if end > start:
            spans.append((start, end))
    return spans


# ----------------------------------------------------------------------------------------------------------
# Response parsing


@dataclass
class ParsedResponse:
    """A model response split into its parts (§11.4).

    ``analysis``: the last ``<analysis>`` block (auto mode's decision), or None. ``think``: the last
    ``<think>`` block, or None. ``answer``: the text after the last ``</analysis>`` and ``</think>``,
    narrowed to the last ``<answer>…</answer>`` if present. ``boxed``: the last ``\\boxed{…}`` content in
    the answer, or None. ``mode``: "think", "no_think", "auto_think" or "auto_no_think".
    """

    analysis: str | None
    think: str | None
    answer: str
    boxed: str | None
    mode: str
    raw: str


def _last_block(text: str, tag: str) -> tuple[str | None, str]:
    """(content of the last <tag>…</tag>, text after it). A close tag with no open tag takes everything
    before it (the open tag may have been part of the prompt)."""
    close = f"</{tag}>"
    pos = text.rfind(close)
    if pos < 0:
        return None, text
    before, after = text[:pos], text[pos + len(close) :]
    open_pos = before.rfind(f"<{tag}>")
    content = before[open_pos + len(tag) + 2 :] if open_pos >= 0 else before
    return content.strip(), after


_END_MARKERS = re.compile(r"(\s*(<\|im_end\|>|<\|endoftext\|>))+\s*$")


def parse_response(text: str) -> ParsedResponse:
    """Split a decoded response into analysis / think / answer / boxed and report the mode used.

    Trailing ``<|im_end|>`` / ``<|endoftext|>`` (decoding without ``skip_special_tokens``) are ignored.
    """
    analysis, rest = _last_block(_END_MARKERS.sub("", text), "analysis")
    think, rest = _last_block(rest, "think")
    m = list(re.finditer(r"<answer>(.*?)</answer>", rest, re.DOTALL))
    if m:
        answer = m[-1].group(1)
    elif "<answer>" in rest:
        answer = rest[rest.rfind("<answer>") + len("<answer>") :]
    else:
        answer = rest
    answer = answer.strip()
    boxed = extract_boxed(answer)
    thought = bool(think)
    if analysis is not None:
        mode = "auto_think" if thought else "auto_no_think"
    else:
        mode = "think" if thought else "no_think"
    return ParsedResponse(analysis, think, answer, boxed, mode, text)
