"""What the demo and ``keye chat`` share: media checks, conversation building and streamed replies.

A :class:`ChatSession` holds the media of one conversation (videos and/or images), the per-item
processing options and the finished turns. Every new question re-renders the whole conversation (media in
the first user turn, earlier answers as plain assistant text, as the official chat template expects) and
runs the processor on it, so changing fps or the token budget mid-chat takes effect on the next turn.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keye.errors import KeyeInputError

VIDEO_EXTS = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpeg", ".mpg", ".3gp", ".ts", ".flv", ".wmv")
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TOKEN_PIXELS = 28 * 28  # one LLM visual token = one 2x2 merge of 14-pixel patches
MODES = ("auto", "think", "no_think")


def media_kind(path: str | Path) -> str:
    """``"video"`` or ``"image"`` from the file extension (case-insensitive).

    Raises :class:`KeyeInputError` naming the file for any other extension, listing the accepted ones.
    """
    suffix = Path(path).suffix.lower()
    if suffix in VIDEO_EXTS:
        return "video"
    if suffix in IMAGE_EXTS:
        return "image"
    raise KeyeInputError(
        f"unsupported file type {suffix or '(no extension)'!r}; upload a video "
        f"({', '.join(e[1:] for e in VIDEO_EXTS[:6])}, ...) or an image ({', '.join(e[1:] for e in IMAGE_EXTS[:5])}, ...)",
        path=Path(path).name,
    )


def check_media(paths: Sequence[str | Path], max_video_seconds: float | None = None) -> list[tuple[str, str]]:
    """Validate uploaded files before any decoding; returns ``[(kind, path), ...]`` in upload order.

    Checks: the file exists and is not empty, its extension is a known video/image type, a video's
    container opens and has frames (PyAV demux, no decoding), and a video is at most ``max_video_seconds``
    long. Raises :class:`KeyeInputError` naming the file and the problem.
    """
    from keye.processing.video import probe_video

    out = []
    for p in paths:
        path = Path(p)
        kind = media_kind(path)
        if not path.is_file():
            raise KeyeInputError("file not found", path=path.name)
        if path.stat().st_size == 0:
            raise KeyeInputError("file is empty", path=path.name)
        if kind == "video":
            try:
                probe = probe_video(str(path))
            except KeyeInputError as err:
                # The upload's temporary path means nothing to the user; name the file only.
                raise KeyeInputError(err.reason, path=path.name) from None
            if max_video_seconds is not None and probe.duration > max_video_seconds:
                raise KeyeInputError(
                    f"video is too long ({probe.duration:.1f} s); this demo accepts at most "
                    f"{max_video_seconds:g} s, trim it or raise --max-video-seconds",
                    path=path.name,
                )
        out.append((kind, str(path)))
    return out


@dataclass
class VideoSettings:
    """Per-video processing options (the message schema's keys; see :class:`keye.processing.video.VideoOptions`).

    ``fps`` frames per second sampled; ``max_frames`` cap on sampled frames; ``token_budget`` total LLM
    tokens for the whole video (``total_pixels = token_budget * 784``); ``slow_fast`` and
    ``min_frame_similarity`` control Keye-VL-1.5's slow/fast frame split (ignored by preview checkpoints).
    None means "the processor's default" (the checkpoint's ``video_defaults``, else Keye's).
    """

    fps: float | None = 2.0
    max_frames: int | None = 32
    token_budget: int | None = 16384
    slow_fast: bool | None = True
    min_frame_similarity: float | None = 0.9

    @classmethod
    def for_checkpoint(cls, processor: Any, base: VideoSettings | None = None) -> VideoSettings:
        """``base`` (default: the demo's defaults) with the checkpoint's own ``video_defaults``
        (preprocessor_config.json: fps, max_frames, total_pixels, slow_fast, min_frame_similarity) on top,
        so a model is asked with the sampling it was trained with unless the user changes it."""
        base = base or cls()
        config = getattr(getattr(processor, "image_processor", None), "config", None)
        vd = dict(getattr(config, "video_defaults", None) or {})
        budget = vd.get("total_pixels")
        return cls(
            fps=vd.get("fps", base.fps),
            max_frames=vd.get("max_frames", base.max_frames),
            token_budget=int(budget) // TOKEN_PIXELS if budget else base.token_budget,
            slow_fast=vd.get("slow_fast", base.slow_fast),
            min_frame_similarity=vd.get("min_frame_similarity", base.min_frame_similarity),
        )

    def item(self, path: str) -> dict[str, Any]:
        """The ``{"type": "video", ...}`` content item for ``path`` with these options."""
        d: dict[str, Any] = {"type": "video", "video": path}
        if self.slow_fast is not None:
            d["slow_fast"] = bool(self.slow_fast)
        if self.min_frame_similarity is not None:
            d["min_frame_similarity"] = float(self.min_frame_similarity)
        if self.fps is not None:
            d["fps"] = float(self.fps)
        if self.max_frames is not None:
            d["max_frames"] = int(self.max_frames)
        if self.token_budget is not None:
            d["total_pixels"] = int(self.token_budget) * TOKEN_PIXELS
        return d


@dataclass
class SamplingSettings:
    """Decoding settings passed to ``KeyeVL.generate_steps``; ``greedy`` switches sampling off."""

    max_new_tokens: int = 512
    greedy: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    top_k: int = 50
    repetition_penalty: float = 1.0

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``model.stream`` / ``model.generate``; raises KeyeInputError if out of range."""
        if self.max_new_tokens < 1:
            raise KeyeInputError(f"max new tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy:
            if self.temperature <= 0:
                raise KeyeInputError(f"temperature must be > 0 when sampling, got {self.temperature}")
            if not 0 < self.top_p <= 1:
                raise KeyeInputError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.repetition_penalty <= 0:
            raise KeyeInputError("top-k must be >= 0 and the repetition penalty > 0")
        kw: dict[str, Any] = {
            "max_new_tokens": int(self.max_new_tokens),
            "do_sample": not self.greedy,
            "repetition_penalty": float(self.repetition_penalty),
        }
        if not self.greedy:
            kw.update(temperature=float(self.temperature), top_p=float(self.top_p), top_k=int(self.top_k))
        return kw


@dataclass
class ChatSession:
    """One conversation about a fixed set of media files.

    ``media`` is ``[(kind, path)]`` (from :func:`check_media`); ``turns`` the finished
    ``(question, answer)`` pairs, the answer without its thinking (earlier thoughts are not fed back).
    """

    media: list[tuple[str, str]] = field(default_factory=list)
    turns: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def for_files(cls, paths: Sequence[str | Path], max_video_seconds: float | None = None) -> ChatSession:
        """A new conversation about the files ``paths``, checked first (:func:`check_media`, which raises
        :class:`KeyeInputError` naming a bad file)."""
        return cls(media=check_media(paths, max_video_seconds))

    def finish_turn(self, question: str, text: str, processor: Any,
                    generated_tokens: int | None) -> tuple[Any, dict[str, Any]]:
        """Record a finished reply to ``question``: ``text`` is parsed with ``processor.parse_response`` and
        ``(question, answer)`` appended to :attr:`turns`. Returns ``(parsed, stats)``, ``stats`` being
        :func:`reply_stats` of the reply (its ``line`` is what the UIs print under the answer)."""
        parsed = processor.parse_response(text)
        self.turns.append((question, parsed.answer))
        return parsed, reply_stats(text, generated_tokens, getattr(processor, "tokenizer", None))

    def messages(self, question: str, video: VideoSettings | None = None) -> list[dict[str, Any]]:
        """The conversation ending in a new user ``question`` (qwen-vl-utils message form)."""
        if not question.strip():
            raise KeyeInputError("the question is empty")
        video = video or VideoSettings()
        items: list[dict[str, Any]] = [
            video.item(p) if kind == "video" else {"type": "image", "image": p} for kind, p in self.media
        ]
        msgs: list[dict[str, Any]] = []
        questions = [q for q, _ in self.turns] + [question]
        for i, q in enumerate(questions):
            content = (items if i == 0 else []) + [{"type": "text", "text": q}]
            msgs.append({"role": "user", "content": content})
            if i < len(self.turns):
                msgs.append({"role": "assistant", "content": self.turns[i][1]})
        return msgs


@dataclass
class StreamView:
    """A partial response split for display: ``thinking`` (None when the reply has no think block yet),
    ``thinking_done`` (the ``</think>`` has arrived) and ``answer`` (text meant for the user so far)."""

    thinking: str | None
    thinking_done: bool
    answer: str


_TAG = re.compile(r"</?(analysis|answer)>")


def split_partial(text: str) -> StreamView:
    """Split a possibly unfinished response into thinking and answer for live display.

    ``<think>...`` without its closing tag is thinking in progress; an ``<analysis>`` block (auto mode's
    decision) is shown with the thinking. ``<answer>`` tags are dropped from the answer text. The final
    split of a finished reply is :func:`keye.processing.chat.parse_response`; this only mirrors it while
    tokens arrive.
    """
    thinking_parts = []
    rest = text
    done = True
    for tag in ("analysis", "think"):
        start = rest.find(f"<{tag}>")
        if start < 0:
            continue
        end = rest.find(f"</{tag}>", start)
        if end < 0:
            thinking_parts.append(rest[start + len(tag) + 2 :].strip())
            rest = rest[:start]
            done = False
            break
        thinking_parts.append(rest[start + len(tag) + 2 : end].strip())
        rest = rest[:start] + rest[end + len(tag) + 3 :]
    thinking = "\n\n".join(p for p in thinking_parts if p) if thinking_parts else None
    return StreamView(thinking, done, _TAG.sub("", rest).strip())


def reply_stats(text: str, generated_tokens: int | None, tokenizer: Any = None) -> dict[str, Any]:
    """Which mode a finished reply used and what it cost, for the line shown under the answer.

    ``generated_tokens`` is the count :func:`stream_reply` leaves in ``stats["tokens"]`` (EOS included,
    the same count ``keye eval`` stores as ``reply_tokens``); the think block is tokenised with
    ``tokenizer``. Returns :func:`keye.eval.modes.reply_stats` (``mode``, ``label``, ``thought``,
    ``reply_tokens``, ``think_tokens``) plus ``line``, e.g. ``"mode: direct · 7 tokens"`` or
    ``"mode: auto → think · 42 tokens (30 thinking)"``.
    """
    from keye.eval.modes import describe_reply
    from keye.eval.modes import reply_stats as _stats

    stats = _stats(text, reply_tokens=generated_tokens, tokenizer=tokenizer)
    stats["line"] = describe_reply(stats)
    return stats


def stream_reply(
    model: Any, processor: Any, batch: Any, sampling: SamplingSettings, stats: dict[str, Any] | None = None
) -> Iterator[str]:
    """Yield the generated text piece by piece for a processed single-conversation ``batch``.

    Special tokens are kept out of the text (the thinking tags are ordinary tokens in Keye's vocabulary
    and stay). ``stats``, if given, gets ``"tokens"`` (tokens generated so far, EOS included) updated as
    decoding runs. Raises :class:`KeyeInputError` for out-of-range sampling settings.
    """
    from keye.model.generation import iter_text

    kwargs = sampling.kwargs()
    batch = batch.to(model.device)
    tensors = {k: v for k, v in batch.items() if k != "labels"}
    for key in ("pixel_values", "pixel_values_videos"):
        if tensors.get(key) is not None:
            tensors[key] = tensors[key].to(model.dtype)
    eos = set(model.config.eos_token_ids or [])
    if stats is not None:
        stats["tokens"] = 0

    def tokens() -> Iterator[int]:
        for nxt, _ in model.generate_steps(**tensors, **kwargs):
            tok = int(nxt[0])
            if stats is not None:
                stats["tokens"] += 1
            if tok in eos:
                return
            yield tok

    yield from iter_text(processor.tokenizer, tokens())
