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


# (offset, signature) of formats that are certainly pictures; GIF and WebP are left out (they may be animations).
_IMAGE_MAGIC = ((0, b"\x89PNG\r\n\x1a\n", "PNG"), (0, b"\xff\xd8\xff", "JPEG"), (0, b"BM", "BMP"),
                (0, b"II*\x00", "TIFF"), (0, b"MM\x00*", "TIFF"))
_VIDEO_MAGIC = ((0, b"\x1a\x45\xdf\xa3", "Matroska/WebM"), (0, b"FLV\x01", "FLV"))
# ISO base media brands of still-image formats (HEIC, AVIF) that share MP4's "ftyp" box.
_STILL_BRANDS = (b"heic", b"heix", b"hevc", b"mif1", b"msf1", b"avif", b"avis")


def sniff_media_kind(path: str | Path) -> tuple[str, str] | None:
    """``("image" | "video", format name)`` when the first bytes of ``path`` certainly say which it is (PNG, JPEG,
    BMP, TIFF pictures; MP4 / MOV, Matroska / WebM, AVI, FLV videos), else None (unknown, or a format that can
    be either, like GIF). Reads 16 bytes; raises nothing (an unreadable file is None)."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return None
    for offset, magic, name in _IMAGE_MAGIC:
        if head[offset:offset + len(magic)] == magic:
            return "image", name
    for offset, magic, name in _VIDEO_MAGIC:
        if head[offset:offset + len(magic)] == magic:
            return "video", name
    if head[4:8] == b"ftyp":
        return ("image", "HEIF/AVIF") if head[8:12] in _STILL_BRANDS else ("video", "MP4/MOV")
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return "video", "AVI"
    return None


def _declared(item: Any) -> tuple[str | None, Path]:
    if isinstance(item, tuple):
        kind, path = item
        if kind not in ("video", "image"):
            raise ValueError(f"media kind must be 'video' or 'image', got {kind!r}")
        return kind, Path(path)
    return None, Path(item)


def check_media(items: Sequence[Any], max_video_seconds: float | None = None) -> list[tuple[str, str]]:
    """Validate media files before any decoding; returns ``[(kind, path), ...]`` in the given order.

    An item is a path (its kind read from the extension: a demo upload) or ``(kind, path)`` with ``kind``
    ``"video"`` or ``"image"`` as the user declared it (``keye chat --video / --image``). Checks: the file
    exists and is not empty; a declared kind agrees with the extension when the extension is a known video or
    image type (an unknown extension is then accepted and the content checked instead); without a declared
    kind the extension must be a known type; a video's container opens and has frames (PyAV demux, no
    decoding) and it is at most ``max_video_seconds`` long; a declared image with an unknown extension is an
    image Pillow can identify; a declared kind also agrees with the file's content where its first bytes say
    what it is (:func:`sniff_media_kind`). Raises :class:`KeyeInputError` naming the file and the problem. Nothing heavy
    is imported before the first video or image needs probing, so a missing file is reported at once.
    """
    out = []
    for item in items:
        declared, path = _declared(item)
        suffix = path.suffix.lower()
        by_extension = "video" if suffix in VIDEO_EXTS else "image" if suffix in IMAGE_EXTS else None
        if declared is None:
            kind = media_kind(path)
        elif by_extension is not None and by_extension != declared:
            raise KeyeInputError(
                f"given with --{declared}, but a {suffix} file is {'an image' if by_extension == 'image' else 'a video'}; "
                f"pass it with --{by_extension}",
                path=path.name,
            )
        else:
            kind = declared
        if not path.is_file():
            raise KeyeInputError("file not found", path=path.name)
        if path.stat().st_size == 0:
            raise KeyeInputError("file is empty", path=path.name)
        sniffed = sniff_media_kind(path)
        if declared is not None and sniffed is not None and sniffed[0] != declared:
            # the content decides over the name: a PNG renamed clip.mp4 is still a picture
            raise KeyeInputError(
                f"given with --{declared}, but it is {'an image' if sniffed[0] == 'image' else 'a video'} "
                f"({sniffed[1]}); pass it with --{sniffed[0]}",
                path=path.name,
            )
        if kind == "video":
            _check_video(path, max_video_seconds)
        elif by_extension is None:
            _check_image(path)
        out.append((kind, str(path)))
    return out


def _check_video(path: Path, max_video_seconds: float | None) -> None:
    from keye.processing.video import probe_video

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


def _check_image(path: Path) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise KeyeInputError(f"not an image Pillow can read ({err.__class__.__name__})", path=path.name) from None


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
        """A new conversation about the files ``paths`` (kinds from their extensions), checked first
        (:func:`check_media`, which raises :class:`KeyeInputError` naming a bad file)."""
        return cls(media=check_media(paths, max_video_seconds))

    @classmethod
    def for_media(cls, media: Sequence[tuple[str, str | Path]], max_video_seconds: float | None = None) -> ChatSession:
        """A new conversation about ``media``, ``[(kind, path)]`` in the order the model is to see them, each
        checked as the kind it was given as (:func:`check_media`; a PNG given as a video is an error naming
        it)."""
        return cls(media=check_media(list(media), max_video_seconds))

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


def generated_tokens(answer_tokens: int, ended_by_eos: bool) -> int:
    """The token count keye reports for a reply, everywhere: the ``keye chat`` footer, the demo's line and
    summary, ``keye serve``'s ``usage.completion_tokens`` (per choice) and ``keye eval``'s ``reply_tokens``.

    It is the number of tokens the model generated: the ``answer_tokens`` that make up the text plus the end
    token when decoding ended on one (it costs a decoding step like any other, and vLLM counts it too). A reply
    cut by the token budget or a stop string counts what was generated, with no end token. ``right`` followed
    by EOS is 2 tokens.
    """
    if answer_tokens < 0:
        raise ValueError(f"answer_tokens must be >= 0, got {answer_tokens}")
    return int(answer_tokens) + (1 if ended_by_eos else 0)


def stream_reply(
    model: Any, processor: Any, batch: Any, sampling: SamplingSettings, stats: dict[str, Any] | None = None
) -> Iterator[str]:
    """Yield the generated text piece by piece for a processed single-conversation ``batch``.

    Special tokens are kept out of the text (the thinking tags are ordinary tokens in Keye's vocabulary
    and stay). ``stats``, if given, gets ``"tokens"`` (tokens generated so far, :func:`generated_tokens`: EOS
    included) updated as decoding runs. Raises :class:`KeyeInputError` for out-of-range sampling settings.
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
        answer = 0
        for nxt, _ in model.generate_steps(**tensors, **kwargs):
            tok = int(nxt[0])
            if tok in eos:
                if stats is not None:
                    stats["tokens"] = generated_tokens(answer, ended_by_eos=True)
                return
            answer += 1
            if stats is not None:
                stats["tokens"] = generated_tokens(answer, ended_by_eos=False)
            yield tok

    yield from iter_text(processor.tokenizer, tokens())
