"""The training manifest: JSONL, one conversation per line.

Each line is a JSON object::

    {"id": "train-000001",                       # optional, defaults to "line-<n>"
     "messages": [                                # required, qwen-vl-utils / KeyeProcessor schema
        {"role": "user", "content": [
            {"type": "video", "video": "media/train/000001.mp4", "fps": 4.0},
            {"type": "text", "text": "What colour is the circle?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "B"}]}],
     "answer": "B", "answer_kind": "mc", "choices": ["red", "blue"],   # optional, for eval / RL rewards
     "question_type": "color", "group": "q-17"}                        # optional

**Multi-answer rows** (SFT on several alternative replies to one prompt): a row-level ``"answers"`` list
replaces the final assistant message; ``messages`` then ends with the user turn the answers reply to::

    {"id": "train-000002",
     "messages": [{"role": "user", "content": [{"type": "image", "image": "media/000002.png"},
                                               {"type": "text", "text": "Describe the picture."}]}],
     "answers": ["A red circle on grey.", "A grey picture with one red circle.", "One red disc."]}

``answers`` must be a non-empty list of non-empty strings and the conversation must not already end with
an assistant turn (which one would be the target?); either mistake makes the row bad, with its line and id.
Training on such a row equals training on one ordinary row per answer (prompt + that answer), each answer
a full sample of the token-mean loss; ``keye train sft`` computes the shared prompt (and its images and
videos) once per row (``train.tree``, see :mod:`keye.sft.trees`). Parsed, the row's ``messages`` end with
an assistant turn holding the first answer as its content and the whole list under ``"answers"``
(:data:`ANSWERS_KEY`), so a consumer that does not know multi-answer rows sees an ordinary SFT row and RL /
evaluation readers, which drop assistant turns, see the prompt; :func:`expand_answers` gives the
one-conversation-per-answer form.

``content`` may also be a plain string. Media paths (``image`` / ``video`` values) that are relative are
resolved against the manifest's root (by default the directory holding the manifest); absolute paths,
``file://`` URLs, ``http(s)://`` URLs and ``data:`` URIs are passed through. A video may also be a list of
frame image paths. Every other key of a content item (``fps``, ``max_pixels``, ``min_pixels``,
``resized_height``, ...) is kept and handed to the processor unchanged.

:func:`read_manifest` parses a manifest into :class:`Sample` objects and collects every malformed row as a
:class:`BadRow` (line number + reason) instead of stopping at the first one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keye.errors import KeyeInputError

ROLES = ("system", "user", "assistant")
ANSWERS_KEY = "answers"  # row-level list of alternative answers; also the key on the parsed final assistant turn
MEDIA_TYPES = ("image", "video")
_PASSTHROUGH_PREFIXES = ("http://", "https://", "data:")


@dataclass(frozen=True)
class MediaRef:
    """One image or video referenced by a sample.

    Attributes:
        kind: ``"image"`` or ``"video"``.
        path: absolute local path (or URL / data URI, passed through); for a frame-list video, the first frame.
        frames: for a video given as a list of frame images, their absolute paths; otherwise ``None``.
        options: the content item's other keys (``fps``, ``max_pixels``, ...), as written in the manifest.
    """

    kind: str
    path: str
    frames: tuple[str, ...] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def is_local(self) -> bool:
        """True when the media is a file on this machine (not a URL or data URI)."""
        return not self.path.startswith(_PASSTHROUGH_PREFIXES)


@dataclass
class Sample:
    """One parsed manifest row.

    Attributes:
        index: 0-based position among the *valid* samples of the manifest (the sampler's sample id).
        line: 1-based line number in the manifest file (for error messages).
        id: the row's ``id`` or ``"line-<line>"``.
        messages: the conversation with media paths resolved to absolute paths (ready for the processor).
        media: every image / video the conversation references, in order of appearance.
        row: the raw JSON object (all optional fields: ``answer``, ``question_type``, ``group``, ...).
    """

    index: int
    line: int
    id: str
    messages: list[dict[str, Any]]
    media: list[MediaRef]
    row: dict[str, Any]

    @property
    def group(self) -> str | None:
        """The RL group id (samples sharing it are kept on one rank), or ``None``."""
        g = self.row.get("group")
        return None if g is None else str(g)

    @property
    def answers(self) -> list[str] | None:
        """The alternative answers of a multi-answer row (in file order), or ``None`` for an ordinary row."""
        return answers_of(self.messages)

    def conversations(self) -> list[list[dict[str, Any]]]:
        """One conversation per answer (the prompt + that answer); ``[messages]`` for an ordinary row."""
        return expand_answers(self.messages)

    @property
    def modality(self) -> str:
        """``"text"``, ``"image"``, ``"video"`` or ``"mixed"`` (images and videos together)."""
        kinds = {m.kind for m in self.media}
        if not kinds:
            return "text"
        if len(kinds) == 2:
            return "mixed"
        return next(iter(kinds))


@dataclass(frozen=True)
class BadRow:
    """A manifest row (or sample) that cannot be used: its 1-based line number, id if known, and why."""

    line: int
    reason: str
    id: str | None = None

    def __str__(self) -> str:
        who = f" ({self.id})" if self.id else ""
        return f"line {self.line}{who}: {self.reason}"


@dataclass
class Manifest:
    """A parsed manifest: the valid samples, the rows rejected while parsing, and where it came from."""

    path: Path
    root: Path
    samples: list[Sample]
    bad_rows: list[BadRow]

    def __len__(self) -> int:
        return len(self.samples)


def resolve_media_path(value: str, root: Path) -> str:
    """Return ``value`` as an absolute local path (relative paths joined to ``root``; ``file://`` stripped).

    URLs (``http://``, ``https://``) and ``data:`` URIs are returned unchanged.
    """
    if value.startswith(_PASSTHROUGH_PREFIXES):
        return value
    if value.startswith("file://"):
        value = value[len("file://") :]
    p = Path(value)
    if not p.is_absolute():
        p = root / p
    return os.path.normpath(str(p))


def _parse_content_item(item: Any, root: Path, where: str) -> tuple[dict[str, Any], MediaRef | None]:
    if not isinstance(item, dict):
        raise ValueError(f"{where} is a {type(item).__name__}, expected an object with a 'type'")
    kind = item.get("type")
    if kind == "text":
        if not isinstance(item.get("text"), str):
            raise ValueError(f"{where} has type 'text' but no string 'text'")
        return dict(item), None
    if kind not in MEDIA_TYPES:
        # qwen-vl-utils also infers the type from the key; accept {"image": ...} without "type".
        inferred = [k for k in MEDIA_TYPES if k in item]
        if kind is None and len(inferred) == 1:
            kind = inferred[0]
        else:
            raise ValueError(f"{where} has unknown type {kind!r} (expected text, image or video)")
    value = item.get(kind)
    options = {k: v for k, v in item.items() if k not in ("type", kind)}
    out = dict(item)
    out["type"] = kind
    if kind == "video" and isinstance(value, list):
        if not value or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where} is a frame-list video but its list is empty or not all strings")
        frames = tuple(resolve_media_path(v, root) for v in value)
        out[kind] = list(frames)
        return out, MediaRef(kind, frames[0], frames, options)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} has type {kind!r} but no path string under {kind!r}")
    path = resolve_media_path(value, root)
    out[kind] = path
    return out, MediaRef(kind, path, None, options)


def parse_row(obj: Any, root: Path) -> tuple[list[dict[str, Any]], list[MediaRef]]:
    """Check one decoded JSON row and return (messages with resolved paths, media refs).

    Raises:
        ValueError: with a one-line reason when the row does not follow the schema (no ``messages`` list,
            unknown role, empty content, unknown content type, media item without a path, no assistant turn
            after the last user turn is *not* an error: prompt-only rows are allowed for RL; a malformed
            ``answers`` list or ``answers`` after a final assistant turn is).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"row is a JSON {type(obj).__name__}, expected an object")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("missing or empty 'messages' list")
    out_msgs: list[dict[str, Any]] = []
    media: list[MediaRef] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] is not an object")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r} (expected one of {', '.join(ROLES)})")
        content = msg.get("content")
        if isinstance(content, str):
            out_msgs.append({"role": role, "content": content})
            continue
        if not isinstance(content, list) or not content:
            raise ValueError(f"messages[{i}].content must be a string or a non-empty list")
        items = []
        for j, item in enumerate(content):
            parsed, ref = _parse_content_item(item, root, f"messages[{i}].content[{j}]")
            if ref is not None and role != "user":
                raise ValueError(f"messages[{i}].content[{j}]: media only allowed in user turns, not {role}")
            items.append(parsed)
            if ref is not None:
                media.append(ref)
        out_msgs.append({"role": role, "content": items})
    if not any(m["role"] == "user" for m in out_msgs):
        raise ValueError("conversation has no user turn")
    if ANSWERS_KEY in obj:
        out_msgs.append(_answers_turn(obj[ANSWERS_KEY], out_msgs))
    return out_msgs, media


def _answers_turn(answers: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The parsed final assistant turn of a multi-answer row (see the module docstring)."""
    if not isinstance(answers, list) or not answers:
        raise ValueError(f"'{ANSWERS_KEY}' must be a non-empty list of answer strings")
    for k, a in enumerate(answers):
        if not isinstance(a, str) or not a.strip():
            raise ValueError(f"{ANSWERS_KEY}[{k}] must be a non-empty string, got {a!r}")
    if messages[-1]["role"] != "user":
        raise ValueError(
            f"'{ANSWERS_KEY}' replaces the final assistant turn, so messages must end with a user turn "
            f"(messages[{len(messages) - 1}] is a {messages[-1]['role']} turn)"
        )
    return {"role": "assistant", "content": [{"type": "text", "text": answers[0]}], ANSWERS_KEY: list(answers)}


def answers_of(messages: list[dict[str, Any]]) -> list[str] | None:
    """The answers list carried by a parsed multi-answer conversation's last turn, else ``None``."""
    last = messages[-1] if messages else None
    if isinstance(last, dict) and last.get("role") == "assistant" and ANSWERS_KEY in last:
        return list(last[ANSWERS_KEY])
    return None


def expand_answers(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A parsed conversation as one conversation per answer: every one shares the prompt's message objects
    (same media items, in the same order) and ends with an ordinary assistant turn holding its answer.
    An ordinary conversation comes back unchanged as ``[messages]``."""
    answers = answers_of(messages)
    if answers is None:
        return [messages]
    prompt = messages[:-1]
    return [prompt + [{"role": "assistant", "content": [{"type": "text", "text": a}]}] for a in answers]


def estimate_cost(cost_model: Any, sample: Sample, *, shared: bool = True) -> Any:
    """Cost of one sample, multi-answer rows included (``cost_model``: a :class:`keye.data.cost.CostModel`).

    An ordinary row is ``cost_model.estimate(sample)``. A multi-answer row with B answers costs, with
    ``shared=True`` (one prefix tree: prompt and media once), the prompt plus each answer's extra tokens:
    ``tokens = P + Σ_b (T_b - P)`` where T_b is answer b's full conversation and P the prompt alone (the
    few template tokens between them are counted per answer, so this is a small over-estimate), vision
    FLOPs once, LLM FLOPs ``F(P) + Σ_b (F(T_b) - F(P))``. With ``shared=False`` (each answer its own
    sample) every field is the sum over the B conversations.

    Raises:
        KeyeInputError: as ``cost_model.estimate`` (missing or corrupt media, sizing rules).
    """
    from dataclasses import replace

    if sample.answers is None:
        return cost_model.estimate(sample)
    convs = expand_answers(sample.messages)
    costs = [cost_model.estimate(replace(sample, messages=c)) for c in convs]
    if not shared:
        return replace(
            costs[0],
            tokens=sum(c.tokens for c in costs),
            text_tokens=sum(c.text_tokens for c in costs),
            media_tokens=sum(c.media_tokens for c in costs),
            segments=tuple(s for c in costs for s in c.segments),
            vision_flops=sum(c.vision_flops for c in costs),
            llm_flops=sum(c.llm_flops for c in costs),
        )
    p = cost_model.estimate(replace(sample, messages=sample.messages[:-1]))
    return replace(
        costs[0],
        tokens=p.tokens + sum(c.tokens - p.tokens for c in costs),
        text_tokens=p.text_tokens + sum(c.text_tokens - p.text_tokens for c in costs),
        llm_flops=p.llm_flops + sum(c.llm_flops - p.llm_flops for c in costs),
    )


def iter_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Yield (1-based line number, stripped text) for every non-blank line of a text file."""
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            text = text.strip()
            if text:
                yield n, text


def read_manifest(path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> Manifest:
    """Parse a JSONL manifest; malformed rows are collected, not raised.

    Args:
        path: the ``.jsonl`` file.
        root: directory that relative media paths are relative to (default: the manifest's directory).

    Returns:
        :class:`Manifest` with the valid samples (``index`` 0..n-1 in file order) and the bad rows.
        Only the schema is checked here; whether media files exist and decode is checked by the probe
        (:func:`keye.data.validate.check_manifest`).

    Raises:
        KeyeInputError: the manifest file itself cannot be read, or duplicate ``id`` values (which would
            make resume and evaluation ambiguous) are reported as bad rows, not raised.
    """
    path = Path(path)
    if not path.is_file():
        raise KeyeInputError("manifest file not found", path=path)
    root_p = Path(root) if root is not None else path.parent
    samples: list[Sample] = []
    bad: list[BadRow] = []
    seen_ids: dict[str, int] = {}
    try:
        lines = list(iter_lines(path))
    except (OSError, UnicodeDecodeError) as err:
        raise KeyeInputError(f"cannot read manifest: {err}", path=path) from err
    for n, text in lines:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as err:
            bad.append(BadRow(n, f"invalid JSON: {err.msg} at column {err.colno}"))
            continue
        sid = obj.get("id") if isinstance(obj, dict) else None
        try:
            messages, media = parse_row(obj, root_p)
        except ValueError as err:
            bad.append(BadRow(n, str(err), None if sid is None else str(sid)))
            continue
        sid = str(sid) if sid is not None else f"line-{n}"
        if sid in seen_ids:
            bad.append(BadRow(n, f"duplicate id {sid!r} (first on line {seen_ids[sid]})", sid))
            continue
        seen_ids[sid] = n
        samples.append(Sample(len(samples), n, sid, messages, media, obj))
    return Manifest(path, root_p, samples, bad)


def write_manifest(path: str | os.PathLike[str], rows: list[dict[str, Any]]) -> None:
    """Write rows as JSONL (UTF-8, one compact object per line), atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------ validation


@dataclass
class CheckReport:
    """Result of :func:`check_manifest`.

    Attributes:
        manifest: the parsed manifest.
        bad_rows: every unusable row (schema errors, then missing/corrupt media and sizing-rule failures),
            sorted by line.
        summary: ``rows``, ``valid``, ``bad``, ``modalities`` (samples per text/image/video/mixed),
            ``images``, ``videos``, ``video_seconds`` (total duration), ``tokens`` (sum over valid rows,
            a multi-answer row counted as its prefix tree, see :func:`estimate_cost`;
            exact when a processor was given, otherwise the approximation described in
            :func:`check_manifest`), ``tokens_exact`` (bool), ``max_tokens``, ``vision_tflops``, ``llm_tflops``.
    """

    manifest: Manifest
    bad_rows: list[BadRow]
    summary: dict[str, Any]

    def format(self, max_rows: int = 50) -> str:
        """Human-readable report: the bad rows (up to ``max_rows``) then the summary."""
        out = [f"{b}" for b in self.bad_rows[:max_rows]]
        if len(self.bad_rows) > max_rows:
            out.append(f"... and {len(self.bad_rows) - max_rows} more bad rows")
        s = self.summary
        mods = ", ".join(f"{k} {v}" for k, v in s["modalities"].items())
        approx = "" if s["tokens_exact"] else " (approximate: no processor given)"
        out += [
            f"rows: {s['rows']}  valid: {s['valid']}  bad: {s['bad']}",
            f"samples by modality: {mods}",
            f"media: {s['images']} images, {s['videos']} videos, {s['video_seconds']:.1f} s of video",
            f"tokens: {s['tokens']:,} total, max {s['max_tokens']:,} per sample{approx}",
            f"forward compute: vision {s['vision_tflops']:.3f} TFLOP, LLM {s['llm_tflops']:.3f} TFLOP (Keye-VL-8B)",
        ]
        return "\n".join(out)


def check_manifest(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    *,
    processor: Any = None,
    cache: Any = None,
) -> CheckReport:
    """Validate a manifest completely: schema, media existence and decodability, and the processor's sizing
    rules; count modalities, video duration and tokens.

    Args:
        processor: a :class:`keye.processing.processor.KeyeProcessor`; with it the token counts are exact
            (:class:`keye.data.cost.CostModel`). Without it, a preview processor with a stand-in tokenizer
            is used: media tokens follow the preview sizing rules exactly, text tokens are approximated as
            UTF-8 bytes / 4.
        cache: a :class:`keye.data.probe.ProbeCache` (default: the user cache).

    Returns:
        :class:`CheckReport`. Problems with rows are reported, never raised.

    Raises:
        KeyeInputError: the manifest file itself is missing or unreadable.
    """
    from keye.data.cost import CostModel
    from keye.data.probe import ProbeCache, probe_media

    man = read_manifest(path, root)
    cache = cache if cache is not None else ProbeCache()
    exact = processor is not None
    cm = CostModel(processor if exact else _approx_processor(), cache=cache)
    bad = list(man.bad_rows)
    modalities: dict[str, int] = {}
    n_img = n_vid = 0
    seconds = 0.0
    tokens: list[int] = []
    v_fl = l_fl = 0.0
    for s in man.samples:
        try:
            cost = estimate_cost(cm, s)
        except KeyeInputError as err:
            bad.append(BadRow(s.line, err.reason, s.id))
            continue
        modalities[s.modality] = modalities.get(s.modality, 0) + 1
        for ref in s.media:
            if ref.kind == "image":
                n_img += 1
            else:
                n_vid += 1
                seconds += probe_media(ref, cache).duration
        tokens.append(cost.tokens)
        v_fl += cost.vision_flops
        l_fl += cost.llm_flops
    bad.sort(key=lambda b: b.line)
    rows = len(man.samples) + len(man.bad_rows)
    summary = {
        "rows": rows,
        "valid": rows - len(bad),
        "bad": len(bad),
        "modalities": dict(sorted(modalities.items())),
        "images": n_img,
        "videos": n_vid,
        "video_seconds": seconds,
        "tokens": int(sum(tokens)),
        "tokens_exact": exact,
        "max_tokens": int(max(tokens, default=0)),
        "vision_tflops": v_fl / 1e12,
        "llm_tflops": l_fl / 1e12,
    }
    return CheckReport(man, bad, summary)


class _ApproxTokenizer:
    """Stand-in tokenizer for :func:`check_manifest` without a processor: ceil(UTF-8 bytes / 4) tokens."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        n = -(-len(text.encode("utf-8")) // 4)
        return {"input_ids": [0] * n}


@dataclass
class _ApproxProcessor:
    variant: str
    tokenizer: Any
    image_processor: Any
    chat_template: Any
    video_backend: str | None = None


def _approx_processor() -> _ApproxProcessor:
    from keye.processing.chat import ChatTemplate
    from keye.processing.image import PREVIEW, ImageProcessorConfig, KeyeImageProcessor

    return _ApproxProcessor(
        PREVIEW, _ApproxTokenizer(), KeyeImageProcessor(ImageProcessorConfig(variant=PREVIEW)), ChatTemplate()
    )
