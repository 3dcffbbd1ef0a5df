"""``KeyeProcessor``: conversations (qwen-vl-utils message form) -> model-ready tensors.

One call renders each conversation with the official chat template, loads and processes every image
and video it mentions, expands the placeholders to the exact token runs (preview: ``t*h*w/4`` pads;
1.5 videos: the per-frame ``<|frame|>`` + timestamp + pads layout of §10.6), tokenizes, pads the batch
and (for training) builds labels that cover only assistant turns.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.processing.chat import (
    OFFICIAL_CHAT_TEMPLATE,
    ChatTemplate,
    ParsedResponse,
    apply_mode,
    assistant_spans,
    item_kind,
    parse_response,
    validate_messages,
)
from keye.processing.image import (
    PREVIEW,
    V1_5,
    ImageProcessorConfig,
    KeyeImageProcessor,
    check_variant,
    load_image,
    prepare_image,
)
from keye.processing.slowfast import FAST, classify_frames, resize_frames, slowfast_sizes
from keye.processing.video import VideoOptions, fetch_video

IGNORE_INDEX = -100
PROCESSOR_CLASS = {PREVIEW: "KeyeProcessor", V1_5: "KeyeVL1_5Processor"}
ARCHITECTURES = {"KeyeForConditionalGeneration": PREVIEW, "KeyeVL1_5ForConditionalGeneration": V1_5}
_PLACEHOLDER = re.compile(r"<\|image_pad\|>|<\|video_pad\|>")
_HUB_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class KeyeBatch(dict):
    """The processor's output: a ``dict`` of tensors (so ``model(**batch)`` works) with attribute access.

    Non-tensor extras live in attributes, not keys: ``video_meta`` (list of :class:`VideoMeta`, in
    batch order) and ``image_meta`` (list of :class:`ImageMeta`).
    """

    def __init__(
        self, data: dict[str, torch.Tensor], video_meta: list | None = None, image_meta: list | None = None
    ):
        super().__init__(data)
        self.__dict__["video_meta"] = video_meta or []
        self.__dict__["image_meta"] = image_meta or []

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device: str | torch.device, dtype: torch.dtype | None = None) -> KeyeBatch:
        """Move every tensor to ``device`` and, if ``dtype`` is given, cast the pixel tensors to it
        (``second_per_grid_ts`` stays float32: the time positions depend on its float32 maths). Returns self."""
        for k, v in self.items():
            if dtype is not None and k.startswith("pixel_values"):
                self[k] = v.to(device=device, dtype=dtype)
            else:
                self[k] = v.to(device)
        return self


@dataclass
class ImageMeta:
    """Per image: batch row, source, original ``(h, w)``, processed ``(h, w)``, grid (patch units), tokens."""

    row: int
    index: int
    source: str
    original_hw: tuple[int, int]
    resized_hw: tuple[int, int]
    grid_thw: list[int]
    tokens: int


@dataclass
class VideoMeta:
    """Per video: sampled frame indices into the source, their true timestamps (s), ``frame_types``
    ("slow"/"fast"; all "slow" for the preview), per-frame grids ``[1, h, w]`` and LLM tokens."""

    row: int
    index: int
    source: str
    backend: str | None
    indices: list[int]
    timestamps: list[float] | None
    sample_fps: float
    frame_types: list[str]
    frame_grids: list[list[int]]
    frame_tokens: list[int]
    tokens: int
    video_fps: float | None = None
    total_frames: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def _merge_thw(rows: list[list[int]]) -> list[list[int]]:
    """Merge consecutive identical ``[1, h, w]`` rows into ``[k, h, w]`` (the 1.5 ``merge_thw``)."""
    out: list[list[int]] = []
    for t, h, w in rows:
        if out and out[-1][1:] == [h, w]:
            out[-1][0] += t
        else:
            out.append([t, h, w])
    return out


def _source_name(src: Any) -> str:
    if isinstance(src, (str, Path)):
        s = str(src)
        return s if len(s) < 200 else s[:60] + "..."
    return type(src).__name__


# Arguments transformers.AutoProcessor forwards to a registered processor's from_pretrained.
_AUTO_PROCESSOR_KWARGS = frozenset({
    "_from_auto", "_from_pipeline", "trust_remote_code", "revision", "cache_dir", "token", "local_files_only",
    "force_download", "proxies", "subfolder", "code_revision", "_commit_hash",
})


class KeyeProcessor:
    """Messages -> tensors for Keye-VL preview and 1.5 checkpoints.

    Args:
        tokenizer: a ``transformers`` tokenizer (the checkpoint's own); special tokens are resolved by name.
        image_config: the checkpoint's :class:`ImageProcessorConfig`.
        variant: ``"preview"`` or ``"1.5"``.
        chat_template: jinja source (default: the official template).
        video_backend: ``"pyav"``, ``"decord"``, ``"torchcodec"`` or None (auto; env ``KEYE_VIDEO_BACKEND``).
    """

    def __init__(
        self,
        tokenizer: Any,
        image_config: ImageProcessorConfig | None = None,
        variant: str = PREVIEW,
        chat_template: str | None = None,
        video_backend: str | None = None,
    ):
        self.variant = check_variant(variant)
        self.tokenizer = tokenizer
        self.image_processor = KeyeImageProcessor(image_config or ImageProcessorConfig(variant=variant))
        self.chat_template = ChatTemplate(chat_template or OFFICIAL_CHAT_TEMPLATE)
        self.video_backend = video_backend
        names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
        names += ["<|image_pad|>", "<|video_pad|>"]
        if variant == V1_5:
            names += ["<|frame|>", "<|fast_start|>", "<|fast_end|>"]
        self.token_ids = {n: self._token_id(n) for n in names}
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.token_ids["<|endoftext|>"]
        )

    def _token_id(self, name: str) -> int:
        tid = self.tokenizer.convert_tokens_to_ids(name)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if tid is None or (unk is not None and tid == unk) or not isinstance(tid, int):
            raise KeyeConfigError(
                f"tokenizer has no {name} token, required by the Keye-VL {self.variant} processor"
            )
        return tid

    @property
    def image_token_id(self) -> int:
        """Id of ``<|image_pad|>`` in this tokenizer."""
        return self.token_ids["<|image_pad|>"]

    @property
    def video_token_id(self) -> int:
        """Id of ``<|video_pad|>`` in this tokenizer."""
        return self.token_ids["<|video_pad|>"]

    # ------------------------------------------------------------------------------------------------------
    # Loading and saving

    @staticmethod
    def _resolve_dir(path_or_hub_id: str | Path) -> Path:
        p = Path(path_or_hub_id)
        if p.is_dir():
            return p
        s = str(path_or_hub_id)
        if s.startswith((".", "/", "~")) or s.count("/") != 1:
            raise KeyeConfigError(
                f"processor directory {s} does not exist (and it is not a hub id 'owner/name')"
            )
        try:
            from huggingface_hub import snapshot_download

            offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
            return Path(snapshot_download(repo_id=s, allow_patterns=_HUB_FILES, local_files_only=offline))
        except Exception as err:  # hub errors come in many classes; all mean "cannot get the files"
            raise KeyeConfigError(
                f"cannot fetch processor files for hub id {s!r} ({err.__class__.__name__}: {err}). If this machine "
                "is offline, download the checkpoint elsewhere and pass its local directory."
            ) from err

    @staticmethod
    def detect_variant(directory: str | Path, variant: str | None = None) -> str:
        """Variant of a checkpoint directory: ``config.json`` architectures, else the preprocessor config's
        ``processor_class``, else ``variant``, else ``"preview"``. A given ``variant`` that contradicts
        the files raises :class:`KeyeConfigError`."""
        d = Path(directory)
        found = None
        cfg = d / "config.json"
        if cfg.is_file():
            archs = json.loads(cfg.read_text()).get("architectures") or []
            found = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        pre = d / "preprocessor_config.json"
        if found is None and pre.is_file():
            cls = json.loads(pre.read_text()).get("processor_class")
            found = {v: k for k, v in PROCESSOR_CLASS.items()}.get(cls)
        if found is not None and variant is not None and variant != found:
            raise KeyeConfigError(
                f"{d} holds a Keye-VL {found} checkpoint but variant={variant!r} was requested"
            )
        return check_variant(found or variant or PREVIEW)

    @classmethod
    def from_pretrained(
        cls, path_or_hub_id: str | Path, variant: str | None = None, video_backend: str | None = None,
        **hub_kwargs: Any,
    ) -> KeyeProcessor:
        """Load from a local directory, a hub id (``snapshot_download`` of the small files only) or
        ``"keye-tiny"`` (the embedded default model; an unknown name's error points at ``keye.load_tiny()``).

        Reads the tokenizer with ``transformers.AutoTokenizer``, ``preprocessor_config.json`` and
        ``chat_template.json`` (or ``chat_template.jinja``; default: the official template).
        Raises :class:`KeyeConfigError` for a missing directory, unreachable hub or broken files.
        ``hub_kwargs`` are the bookkeeping arguments ``transformers.AutoProcessor`` passes along
        (``trust_remote_code``, ``revision``, ...); they are accepted and not needed.
        """
        unknown = sorted(set(hub_kwargs) - _AUTO_PROCESSOR_KWARGS)
        if unknown:
            raise TypeError(f"KeyeProcessor.from_pretrained got unsupported argument(s): {', '.join(unknown)}")
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        # "keye-tiny" (the name every CLI accepts) -> the embedded checkpoint; an unknown name says what works
        from keye.hub import resolve_pretrained

        d = cls._resolve_dir(resolve_pretrained(path_or_hub_id))
        var = cls.detect_variant(d, variant)
        # AutoTokenizer also parses the model's config.json, whose Keye model_type transformers does not
        # know; its warnings about that are noise for a tokenizer load.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            # The checkpoint config.json may carry auto_map (remote code); the tokenizer never needs it.
            tokenizer = AutoTokenizer.from_pretrained(str(d), trust_remote_code=False)
        except Exception as err:  # transformers raises OSError/ValueError/... for broken tokenizer files
            raise KeyeConfigError(f"cannot load the tokenizer from {d}: {err}") from err
        finally:
            hf_logging.set_verbosity(verbosity)
        pre = d / "preprocessor_config.json"
        image_config = (
            ImageProcessorConfig.from_file(pre, var) if pre.is_file() else ImageProcessorConfig(variant=var)
        )
        template = None
        if (d / "chat_template.json").is_file():
            template = json.loads((d / "chat_template.json").read_text()).get("chat_template")
        elif (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        return cls(tokenizer, image_config, var, template, video_backend)

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write tokenizer files, ``preprocessor_config.json`` and ``chat_template.json`` to ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(str(d))
        pre = self.image_processor.config.to_dict()
        pre["processor_class"] = PROCESSOR_CLASS[self.variant]
        (d / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
        (d / "chat_template.json").write_text(
            json.dumps({"chat_template": self.chat_template.source}, indent=2)
        )
        return d

    def override_preprocessor(self, overrides: dict[str, Any], where: str = "preprocessor overrides") -> None:
        """Replace fields of ``preprocessor_config.json`` in place (e.g. ``{"max_pixels": 25088}``).

        ``video_defaults`` is merged key by key into the current one, so ``{"video_defaults":
        {"max_pixels": 25088}}`` keeps its fps and frame limits. The result is validated as a loaded file
        would be, and :meth:`save_pretrained` writes it, so a checkpoint trained at the new budget carries
        it. Raises :class:`KeyeConfigError` naming ``where`` for an unknown field or an invalid result,
        leaving the processor unchanged.
        """
        if not overrides:
            return
        current = self.image_processor.config
        fields = set(current.__dataclass_fields__) - {"variant"}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise KeyeConfigError(
                f"{where}: unknown preprocessor field(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}"
            )
        merged = current.to_dict()
        for key, value in overrides.items():
            if key == "video_defaults":
                if not isinstance(value, dict):
                    raise KeyeConfigError(f"{where}: video_defaults must be a mapping, got {value!r}")
                merged["video_defaults"] = {**(current.video_defaults or {}), **value}
            else:
                merged[key] = value
        try:
            new = ImageProcessorConfig.from_dict(merged, self.variant)
            VideoOptions.from_item(new.video_defaults, item=where)
        except (KeyeConfigError, KeyeInputError, TypeError) as err:
            raise KeyeConfigError(f"{where}: {err}") from err
        self.image_processor.config = new

    # ------------------------------------------------------------------------------------------------------
    # Decoding

    def decode(self, ids: Any, skip_special_tokens: bool = True, **kw: Any) -> str:
        """Token ids (list / 1-D tensor) -> text. ``<think>`` tags are not special and survive."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, **kw)

    def batch_decode(self, ids: Any, skip_special_tokens: bool = True, **kw: Any) -> list[str]:
        """``[B, L]`` ids -> list of B strings."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return [self.decode(row, skip_special_tokens=skip_special_tokens, **kw) for row in ids]

    @staticmethod
    def parse_response(text: str) -> ParsedResponse:
        """Split a response into analysis / think / answer / boxed and the mode used (see chat.py)."""
        return parse_response(text)

    # ------------------------------------------------------------------------------------------------------
    # Vision items

    def _process_image(
        self, content: dict[str, Any], row: int, index: int
    ) -> tuple[torch.Tensor, list[int], ImageMeta]:
        src = content.get("image", content.get("image_url"))
        if isinstance(src, dict):  # OpenAI form {"image_url": {"url": ...}}
            src = src.get("url")
        if src is None:
            raise KeyeInputError("image item has no 'image' / 'image_url' source", item=f"image {index}")
        where = f"image {index} (row {row})"
        img = load_image(src, self.variant, where)
        original_hw = (img.height, img.width)
        img = prepare_image(
            img,
            self.variant,
            min_pixels=content.get("min_pixels"),
            max_pixels=content.get("max_pixels"),
            resized_height=content.get("resized_height"),
            resized_width=content.get("resized_width"),
            item=where,
            path=src if isinstance(src, (str, Path)) else None,
        )
        pv, grid = self.image_processor(img, item=where)
        size = self.image_processor.config.patch_size
        merge = self.image_processor.config.merge_size
        tokens = grid[0] * grid[1] * grid[2] // (merge * merge)
        meta = ImageMeta(
            row, index, _source_name(src), original_hw, (grid[1] * size, grid[2] * size), grid, tokens
        )
        return pv, grid, meta

    def _process_video(
        self, content: dict[str, Any], row: int, index: int
    ) -> tuple[torch.Tensor, list[list[int]], VideoMeta, list]:
        """Returns (pixel rows, grid rows, meta, layout); ``layout`` lists (frame_type, tokens, timestamp)."""
        where = f"video {index} (row {row})"
        opts = self.video_options(content, item=where)
        video = fetch_video(content.get("video"), opts, self.variant, backend=self.video_backend, item=where)
        common = dict(
            row=row, index=index, source=video.source, backend=video.backend, indices=video.indices,
            timestamps=video.timestamps, sample_fps=video.sample_fps, video_fps=video.video_fps,
            total_frames=video.total_frames,
        )
        if self.variant == PREVIEW:
            # One block of T frames at one size; time enters only through second_per_grid_ts (§9.6).
            pv, grid = self.image_processor.preprocess_frames(video.frames, item=where)
            n, per_frame = grid[0], grid[1] * grid[2] // self._merge2
            meta = VideoMeta(
                **common,
                frame_types=["slow"] * n,
                frame_grids=[[1, grid[1], grid[2]]] * n,
                frame_tokens=[per_frame] * n,
                tokens=per_frame * n,
            )
            return pv, [grid], meta, [("slow", per_frame * n, None)]
        return self._slow_fast_video(video, opts, where, common)

    def video_options(self, content: dict[str, Any], item: Any = None) -> VideoOptions:
        """The validated options of one video item: the checkpoint's ``video_defaults``
        (preprocessor_config.json) overridden by the item's own keys."""
        defaults = self.image_processor.config.video_defaults
        return VideoOptions.from_item({**defaults, **content} if defaults else content, item=item)

    @property
    def _merge2(self) -> int:
        return self.image_processor.config.merge_size**2

    def _slow_fast_video(
        self, video: Any, opts: VideoOptions, where: str, common: dict[str, Any]
    ) -> tuple[torch.Tensor, list[list[int]], VideoMeta, list]:
        """1.5: classify the sampled frames, budget the two sizes, process each set, interleave back."""
        frames = torch.from_numpy(video.frames).permute(0, 3, 1, 2)  # [n, 3, H, W] uint8
        n = len(frames)
        types = (
            classify_frames(frames, opts.min_frame_similarity) if opts.slow_fast else np.zeros(n, np.int32)
        )
        is_fast = torch.from_numpy(types == FAST)
        n_fast = int(is_fast.sum())
        sizes = slowfast_sizes(
            n - n_fast,
            n_fast,
            frames.shape[2],
            frames.shape[3],
            min_pixels=opts.min_pixels,
            max_pixels=opts.max_pixels,
            total_pixels=opts.total_pixels,
            floor_pixels=opts.floor_pixels,
            item=where,
        )
        if opts.resized_height is not None and not video.presized:  # frame lists are resized already
            sizes = sizes.with_slow_size(opts.resized_height, opts.resized_width)
        sets = {}
        for kind, mask, hw in (("slow", ~is_fast, sizes.slow_hw), ("fast", is_fast, sizes.fast_hw)):
            if bool(mask.any()):
                pv, grid = self.image_processor.preprocess_resized(resize_frames(frames[mask], hw))
                sets[kind] = (pv, [1, grid[1], grid[2]], grid[1] * grid[2])
        pixel_rows, grids, layout = [], [], []
        seen = {"slow": 0, "fast": 0}
        for j in range(n):
            kind = "fast" if types[j] == FAST else "slow"
            pv, g, per = sets[kind]
            k = seen[kind]
            seen[kind] += 1
            pixel_rows.append(pv[k * per : (k + 1) * per])
            grids.append(g)
            ts = video.timestamps[j] if video.timestamps is not None else None
            layout.append((kind, per // self._merge2, ts))
        frame_tokens = [tok for _, tok, _ in layout]
        meta = VideoMeta(
            **common,
            frame_types=[kind for kind, _, _ in layout],
            frame_grids=[list(g) for g in grids],
            frame_tokens=frame_tokens,
            tokens=sum(frame_tokens),
            extra={"slow_hw": list(sizes.slow_hw), "fast_hw": list(sizes.fast_hw)},
        )
        return torch.cat(pixel_rows), _merge_thw([list(g) for g in grids]), meta, layout

    # ------------------------------------------------------------------------------------------------------
    # Tokens

    def _encode_text(
        self, text: str, offset: int, spans: list[tuple[int, int]]
    ) -> tuple[list[int], list[bool]]:
        if not text:
            return [], []
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=bool(spans))
        ids = list(enc["input_ids"])
        if not spans:
            return ids, [False] * len(ids)
        train = [any(s <= offset + a < e for s, e in spans) for a, _ in enc["offset_mapping"]]
        return ids, train

    def _video_tokens(self, layout: list) -> list[int]:
        tid = self.token_ids
        if self.variant == PREVIEW:
            return [tid["<|video_pad|>"]] * layout[0][1]
        out: list[int] = []
        for kind, n, ts in layout:
            out.append(tid["<|frame|>"])
            if ts is not None:
                out += self.tokenizer(format(ts, ".1f"), add_special_tokens=False)["input_ids"]
            if kind == "fast":
                out += [tid["<|fast_start|>"]] + [tid["<|video_pad|>"]] * n + [tid["<|fast_end|>"]]
            else:
                out += [tid["<|video_pad|>"]] * n
        return out

    def __call__(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        return_tensors: str | None = "pt",
        add_generation_prompt: bool | None = None,
        mode: str | None = None,
        for_training: bool = False,
        padding_side: str | None = None,
        add_vision_id: bool = False,
        packing: bool = False,
    ) -> KeyeBatch:
        """Process one conversation or a list of conversations into a :class:`KeyeBatch`.

        Keys: ``input_ids``/``attention_mask`` int64 ``[B, L]``; ``pixel_values`` float32
        ``[N, 3, 14, 14]`` + ``image_grid_thw`` int64 ``[n_images, 3]`` when there are images;
        ``pixel_values_videos`` + ``video_grid_thw`` when there are videos (1.5: per-frame rows, merged
        runs); ``second_per_grid_ts`` float32 ``[n_videos]`` (preview only); ``labels`` when
        ``for_training`` (-100 except assistant-turn tokens incl. the closing ``<|im_end|>``).
        Images and videos are numbered across the batch, row 0 first. ``add_generation_prompt`` defaults
        to ``not for_training``; padding defaults to left for generation and right for training, with
        ``<|endoftext|>``. ``packing=True`` (training only) instead concatenates the conversations into
        one row ``[1, sum L]`` and adds ``seq_lens`` int64 ``[B]`` (the model keeps samples apart).
        Raises :class:`KeyeInputError` naming the item for bad input.
        """
        if packing and not for_training:
            raise KeyeInputError("packing=True is only for training batches (for_training=True)")
        if return_tensors not in ("pt", None):
            raise KeyeInputError(f"return_tensors={return_tensors!r} is not supported; use 'pt'")
        if add_generation_prompt is None:
            add_generation_prompt = not for_training
        side = padding_side or ("right" if for_training else "left")
        if side not in ("left", "right"):
            raise KeyeInputError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        if not isinstance(messages, list) or not messages:
            raise KeyeInputError("messages must be a non-empty list (one conversation or a list of them)")
        batch = messages if isinstance(messages[0], list) else [messages]
        rows_ids, rows_train = [], []
        img_pv, img_grid, img_meta = [], [], []
        vid_pv, vid_grid, vid_meta, vid_fps = [], [], [], []
        for r, conv in enumerate(batch):
            conv = apply_mode(validate_messages(conv, r if len(batch) > 1 else None), mode)
            rendered = self.chat_template.render(conv, add_generation_prompt, add_vision_id)
            items = [
                c
                for m in conv
                if not isinstance(m["content"], str)
                for c in m["content"]
                if item_kind(c) != "text"
            ]
            expansions = []
            for c in items:
                if item_kind(c) == "image":
                    pv, grid, meta = self._process_image(c, r, len(img_meta))
                    img_pv.append(pv)
                    img_grid.append(grid)
                    img_meta.append(meta)
                    expansions.append(("<|image_pad|>", [self.image_token_id] * meta.tokens))
                else:
                    pv, grids, meta, layout = self._process_video(c, r, len(vid_meta))
                    vid_pv.append(pv)
                    vid_grid += grids
                    vid_meta.append(meta)
                    vid_fps.append(meta.sample_fps)
                    expansions.append(("<|video_pad|>", self._video_tokens(layout)))
            spans = assistant_spans(rendered) if for_training else []
            ids: list[int] = []
            train: list[bool] = []
            pos = 0
            placeholders = list(_PLACEHOLDER.finditer(rendered))
            if len(placeholders) != len(expansions) or any(
                p.group(0) != e[0] for p, e in zip(placeholders, expansions)
            ):
                raise KeyeInputError(
                    f"conversation {r}: the text contains literal <|image_pad|>/<|video_pad|> tokens that do not "
                    "match its image/video items"
                )
            for p, (_, expansion) in zip(placeholders, expansions):
                t_ids, t_train = self._encode_text(rendered[pos : p.start()], pos, spans)
                ids += t_ids + expansion
                train += t_train + [False] * len(expansion)
                pos = p.end()
            t_ids, t_train = self._encode_text(rendered[pos:], pos, spans)
            rows_ids.append(ids + t_ids)
            rows_train.append(train + t_train)
        out = (
            self._pack(rows_ids, rows_train)
            if packing
            else self._pad(rows_ids, rows_train, side, for_training)
        )
        if img_pv:
            out["pixel_values"] = torch.cat(img_pv)
            out["image_grid_thw"] = torch.tensor(img_grid, dtype=torch.long)
        if vid_pv:
            out["pixel_values_videos"] = torch.cat(vid_pv)
            out["video_grid_thw"] = torch.tensor(vid_grid, dtype=torch.long)
            if self.variant == PREVIEW:
                # temporal_patch_size (1) / sampled fps, float32 as the reference builds it (§6.3).
                out["second_per_grid_ts"] = torch.tensor([1.0 / f for f in vid_fps], dtype=torch.float32)
        return KeyeBatch(out, vid_meta, img_meta)

    @staticmethod
    def _pack(rows: list[list[int]], train: list[list[bool]]) -> dict:
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)[None]
        keep = torch.tensor([t for r in train for t in r], dtype=torch.bool)[None]
        labels = ids.masked_fill(~keep, IGNORE_INDEX)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": labels,
            "seq_lens": torch.tensor([len(r) for r in rows], dtype=torch.long),
        }

    def _pad(self, rows: list[list[int]], train: list[list[bool]], side: str, for_training: bool) -> dict:
        length = max(len(r) for r in rows)
        ids = torch.full((len(rows), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        for i, (r, t) in enumerate(zip(rows, train)):
            sl = slice(length - len(r), length) if side == "left" else slice(0, len(r))
            ids[i, sl] = torch.tensor(r, dtype=torch.long)
            mask[i, sl] = 1
            if for_training:
                row = torch.tensor(r, dtype=torch.long)
                row[~torch.tensor(t, dtype=torch.bool)] = IGNORE_INDEX
                labels[i, sl] = row
        out = {"input_ids": ids, "attention_mask": mask}
        if for_training:
            out["labels"] = labels
        return out


class KeyeVL1_5Processor(KeyeProcessor):  # noqa: N801 - the official processor_class name
    """:class:`KeyeProcessor` under the official 1.5 name (``processor_class`` of Keye-VL-1.5's
    ``preprocessor_config.json``), so that ``transformers.AutoProcessor`` resolves that name to Keye."""


# This module imports transformers: finish the auto-class registration if it was waiting on us (keye/__init__).
import keye as _keye  # noqa: E402

_keye._register()
