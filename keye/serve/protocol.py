"""OpenAI chat-completions requests -> keye messages and sampling settings, and the response bodies.

The request schema is OpenAI's ``/v1/chat/completions``: ``messages`` whose ``content`` is a string or a
list of parts (``text``, ``image_url``, ``video_url``), ``max_tokens`` (or ``max_completion_tokens``),
``temperature``, ``top_p``, ``stop``, ``n``, ``seed``, ``stream`` and ``stream_options.include_usage``.
Keye's thinking modes are chosen by ``/think`` / ``/no_think`` in the text (as with the official model), by
a ``mode`` field (``"think"``, ``"no_think"``, ``"auto"``) or by vLLM's
``chat_template_kwargs.enable_thinking``. A ``video_url`` part may carry keye's sampling options next to
its ``url`` (``fps``, ``max_frames``, ``nframes``, ``video_start``, ``video_end``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from keye.processing.chat import parse_response
from keye.serve.errors import APIError

_ROLES = ("system", "user", "assistant")
_VIDEO_OPTIONS = {"fps": float, "max_frames": int, "nframes": int, "video_start": float, "video_end": float}
_MODES = {"think": "think", "no_think": "no_think", "auto": "auto"}


@dataclass
class ServerLimits:
    """Per-request limits the server enforces (each violation is a 400 naming the field)."""

    max_tokens: int = 1024
    default_max_tokens: int = 256
    max_n: int = 8
    max_frames: int = 64
    max_media_items: int = 16
    max_stop: int = 4


@dataclass
class MediaRef:
    """One media part to fetch: where it goes in ``messages`` and the request field that named it."""

    message: int
    part: int
    kind: str  # "image" | "video"
    url: str
    param: str


@dataclass
class ChatRequest:
    """A validated chat request: keye messages (media parts still hold their URLs, see ``media``) and
    the sampling settings."""

    messages: list[dict[str, Any]]
    media: list[MediaRef]
    model: str | None
    max_tokens: int
    temperature: float
    top_p: float
    n: int
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    mode: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def do_sample(self) -> bool:
        """OpenAI's convention: temperature 0 is greedy decoding (and ``n`` greedy choices are ``n`` copies of
        the one greedy answer, decoded once)."""
        return self.temperature > 0


def _number(body: dict, key: str, kind: type, default: Any, lo: float | None = None, hi: float | None = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise APIError(400, f"{key}: expected {'an integer' if kind is int else 'a number'}, got {value!r}", param=key)
    value = kind(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise APIError(400, f"{key}: {value} is outside the allowed range [{lo}, {hi}]", param=key)
    return value


def _text_part(part: dict, param: str) -> dict[str, Any]:
    text = part.get("text")
    if not isinstance(text, str):
        raise APIError(400, f"{param}.text: expected a string", param=f"{param}.text")
    return {"type": "text", "text": text}


def _media_part(part: dict, kind: str, param: str, limits: ServerLimits) -> tuple[dict[str, Any], str]:
    key = f"{kind}_url"
    ref = part.get(key)
    if isinstance(ref, str):
        ref = {"url": ref}
    if not isinstance(ref, dict) or not isinstance(ref.get("url"), str):
        raise APIError(400, f"{param}.{key}: expected an object with a 'url' string", param=f"{param}.{key}")
    item: dict[str, Any] = {"type": kind, kind: None}
    if kind == "video":
        for opt, typ in _VIDEO_OPTIONS.items():
            if opt in ref:
                val = ref[opt]
                if isinstance(val, bool) or not isinstance(val, (int, float)) or val < 0:
                    raise APIError(400, f"{param}.{key}.{opt}: expected a non-negative number, got {val!r}",
                                   param=f"{param}.{key}.{opt}")
                item[opt] = typ(val)
        for opt in ("max_frames", "nframes"):
            if item.get(opt, 0) > limits.max_frames:
                raise APIError(400, f"{param}.{key}.{opt}: {item[opt]} frames asked, the server allows at most "
                               f"{limits.max_frames} per video", param=f"{param}.{key}.{opt}", code="too_many_frames")
        item.setdefault("max_frames", limits.max_frames)
    return item, ref["url"]


def parse_chat_request(body: Any, limits: ServerLimits) -> ChatRequest:
    """Validate an OpenAI chat-completions body; raises :class:`APIError` (400) naming the bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "messages: expected a non-empty list of messages", param="messages")
    messages: list[dict[str, Any]] = []
    media: list[MediaRef] = []
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise APIError(400, f"{where}: expected an object with 'role' and 'content'", param=where)
        role = msg.get("role")
        if role == "developer":
            role = "system"
        if role not in _ROLES:
            raise APIError(400, f"{where}.role: {role!r} is not one of {list(_ROLES)}", param=f"{where}.role")
        content = msg.get("content")
        if isinstance(content, str):
            parts: list[dict[str, Any]] = [{"type": "text", "text": content}]
        elif isinstance(content, list) and content:
            parts = []
            for j, part in enumerate(content):
                p = f"{where}.content[{j}]"
                ptype = part.get("type") if isinstance(part, dict) else None
                if ptype == "text":
                    parts.append(_text_part(part, p))
                elif ptype in ("image_url", "video_url"):
                    kind = ptype.removesuffix("_url")
                    if role != "user":
                        raise APIError(400, f"{p}: only user messages may carry {ptype} parts", param=p)
                    item, url = _media_part(part, kind, p, limits)
                    media.append(MediaRef(i, len(parts), kind, url, f"{p}.{ptype}.url"))
                    parts.append(item)
                else:
                    raise APIError(400, f"{p}.type: {ptype!r} is not supported (text, image_url, video_url)",
                                   param=f"{p}.type")
        else:
            raise APIError(400, f"{where}.content: expected a string or a non-empty list of parts",
                           param=f"{where}.content")
        messages.append({"role": role, "content": parts})
    if messages[-1]["role"] == "assistant":
        raise APIError(400, "messages: the last message must not be the assistant's (nothing to answer)",
                       param="messages")
    if len(media) > limits.max_media_items:
        raise APIError(400, f"messages: {len(media)} media items, the server allows at most {limits.max_media_items}",
                       param="messages")

    if "max_tokens" in body and body["max_tokens"] is not None:
        max_tokens = _number(body, "max_tokens", int, None, 1, limits.max_tokens)
    else:
        max_tokens = _number(body, "max_completion_tokens", int, limits.default_max_tokens, 1, limits.max_tokens)
    temperature = _number(body, "temperature", float, 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", float, 1.0, 0.0, 1.0)
    if top_p == 0:
        raise APIError(400, "top_p: must be greater than 0", param="top_p")
    n = _number(body, "n", int, 1, 1, limits.max_n)
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", int, None, 0, 2**63 - 1)
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise APIError(400, "stop: expected a string or a list of strings", param="stop")
    if len(stops) > limits.max_stop or any(not s for s in stops):
        raise APIError(400, f"stop: at most {limits.max_stop} non-empty strings", param="stop")
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "stream_options: expected an object", param="stream_options")
    mode = body.get("mode")
    if mode is not None and mode not in _MODES:
        raise APIError(400, f"mode: {mode!r} is not one of {sorted(_MODES)}", param="mode")
    kwargs = body.get("chat_template_kwargs") or {}
    if mode is None and isinstance(kwargs, dict) and "enable_thinking" in kwargs:
        mode = "think" if kwargs["enable_thinking"] else "no_think"
    model = body.get("model")
    return ChatRequest(
        messages=messages, media=media, model=model if isinstance(model, str) else None, max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, n=n, seed=seed, stop=stops, stream=stream,
        include_usage=bool(opts.get("include_usage", False)), mode=mode,
    )


_TAGS = ("analysis", "think")
_TAG_RE = re.compile(r"</?(analysis|think|answer)>")


def split_reasoning(text: str, final: bool) -> tuple[str, str]:
    """Split generated text into ``(reasoning, content)``, tags removed.

    ``reasoning`` is what stands inside ``<analysis>`` / ``<think>`` blocks (an unclosed block runs to the
    end), ``content`` everything else (``<answer>`` tags dropped, their text kept). Both only grow as ``text`` grows, so a stream can send their
    differences; unless ``final``, a trailing fragment that may be the start of a tag is held back.
    """
    if not final:
        cut = text.rfind("<")
        if cut >= 0 and ">" not in text[cut:] and any(
            f"<{t}>".startswith(text[cut:]) or f"</{t}>".startswith(text[cut:]) for t in (*_TAGS, "answer")
        ):
            text = text[:cut]
    reasoning, content, inside, pos = [], [], False, 0
    for m in _TAG_RE.finditer(text):
        (reasoning if inside else content).append(text[pos:m.start()])
        if m.group(1) != "answer":
            inside = not m.group(0).startswith("</")
        pos = m.end()
    (reasoning if inside else content).append(text[pos:])
    return "".join(reasoning), "".join(content)


def message_fields(text: str) -> dict[str, Any]:
    """The ``message`` of a finished choice: ``content`` (the answer) and ``reasoning_content`` (the
    analysis and thinking, as vLLM returns them) when the reply has any."""
    reasoning, content = split_reasoning(text, final=True)
    if not reasoning.strip():
        return {"role": "assistant", "content": text, "reasoning_content": None}
    return {"role": "assistant", "content": parse_response(text).answer, "reasoning_content": reasoning.strip()}
