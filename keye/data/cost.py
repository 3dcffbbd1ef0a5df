"""Per-sample cost model: exact token counts and vision/LLM FLOPs, without running the processor.

Token counts follow :class:`keye.processing.processor.KeyeProcessor` step by step, using its own pieces:

* text: the processor's chat template is rendered (training layout: no generation prompt), split at the
  ``<|image_pad|>``/``<|video_pad|>`` placeholders, and each text piece is tokenised with the processor's
  tokenizer, exactly as ``KeyeProcessor.__call__`` does;
* images: :func:`keye.processing.image.image_grid_for_size` (stage-1 ``fetch_image`` + the checkpoint's
  smart_resize) from the header size;
* videos, preview: :func:`keye.processing.video.sample_frames` on the container's true frame times (read
  by demuxing, no decoding) and :func:`~keye.processing.video.preview_video_size`, then the image
  processor's own ``target_size``;
* videos, 1.5: the slow/fast split needs pixels, so the sampled frames are decoded once
  (:func:`~keye.processing.video.fetch_video` + :func:`~keye.processing.slowfast.classify_frames`) and
  the frame types cached; sizes come from :func:`~keye.processing.slowfast.slowfast_sizes`. With
  ``slowfast_exact=False`` every frame is assumed slow instead (no decoding; an upper bound on tokens).

Per-file results are cached in the :class:`~keye.data.probe.ProbeCache` (keyed by path, mtime and size).

**Metadata in the row.** A content item that states its media's size skips the probe: ``"width"`` and
``"height"`` (pixels) for an image; those plus ``"duration"`` (seconds) and ``"num_frames"`` (frames in the
stream) for a video file, whose frames are then taken as evenly spaced at ``num_frames / duration`` fps (exact
for constant-frame-rate files). The values are trusted, not checked against the file; only a missing local
file is still rejected before training (a cheap ``stat``), a corrupt one is found when it is decoded. A 1.5 video with
``slowfast_exact`` is still decoded (its slow/fast frame types need pixels); frame-list videos are probed.

A 1.5 video's per-frame timestamp text is tokenised once per distinct string (``"12.5"`` is the same tokens
wherever it appears), not once per frame. :func:`estimate_parallel` runs the cost model over a table in
worker processes.

FLOPs are forward-pass multiply-adds x 2 of the Keye-VL blocks (architecture.md §1-5): for a vision
attention segment of P patches (width d, MLP m, L layers), ``2*P*588*d + L*(8*P*d^2 + 4*P^2*d + 4*P*d*m)``
plus the 2x2-merge projector ``2*(P/4)*(4d*4d + 4d*D)``; for an LLM sequence of S tokens,
``L*(2*S*D*(H+2*KV)*hd + 2*S*H*hd*D + 6*S*D*I + 2*S^2*H*hd)`` (causal attention: half of the S^2 work)
``+ 2*S*D*V`` for the LM head. Segments: an image is one segment; a preview video is one segment (all
its frames attend to each other); a 1.5 video has one segment per frame. Training costs about 3x these
numbers for trained towers; only ratios matter for balancing.
"""

from __future__ import annotations

import multiprocessing
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from keye.data.manifest import MediaRef, Sample
from keye.data.probe import MediaInfo, ProbeCache, probe_media
from keye.errors import KeyeInputError
from keye.model.arch import TextConfig, VisionConfig

_PLACEHOLDER = re.compile(r"<\|image_pad\|>|<\|video_pad\|>")
_TIMING_VERSION = 1
_TYPES_VERSION = 1


_ARCH_8B = {"vision": VisionConfig(), "text": TextConfig()}


def _dim(part: str, name: str) -> Any:
    """A :class:`ModelDims` field read from ``KeyeVLConfig.<part>.<name>``, defaulting to Keye-VL-8B's."""
    return field(default=getattr(_ARCH_8B[part], name), metadata={"config": (part, name)})


@dataclass(frozen=True)
class ModelDims:
    """The widths and depths FLOPs depend on (defaults: Keye-VL-8B, architecture.md §1, as
    :mod:`keye.model.arch` has them); each field names the config field it comes from."""

    vision_layers: int = _dim("vision", "num_hidden_layers")
    vision_hidden: int = _dim("vision", "hidden_size")
    vision_mlp: int = _dim("vision", "intermediate_size")
    patch_size: int = _dim("vision", "patch_size")
    merge_size: int = _dim("vision", "spatial_merge_size")
    llm_layers: int = _dim("text", "num_hidden_layers")
    llm_hidden: int = _dim("text", "hidden_size")
    llm_mlp: int = _dim("text", "intermediate_size")
    llm_heads: int = _dim("text", "num_attention_heads")
    llm_kv_heads: int = _dim("text", "num_key_value_heads")
    llm_head_dim: int = _dim("text", "head_dim")
    vocab_size: int = _dim("text", "vocab_size")

    @classmethod
    def from_config(cls, cfg: Any) -> ModelDims:
        """From a :class:`keye.config.KeyeVLConfig` (``cfg.vision`` / ``cfg.text``)."""
        return cls(**{f.name: getattr(getattr(cfg, f.metadata["config"][0]), f.metadata["config"][1])
                      for f in fields(cls)})


def given_info(ref: MediaRef) -> MediaInfo | None:
    """The media's size as the manifest row states it (see the module docstring), or ``None`` when the row
    does not state all of it (the media is then probed).

    Raises:
        KeyeInputError: a stated value is not a positive number.
    """
    o = ref.options
    keys = ("width", "height") if ref.kind == "image" else ("width", "height", "duration", "num_frames")
    if ref.frames is not None or not all(o.get(k) is not None for k in keys):
        return None
    for k in keys:
        v = o[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise KeyeInputError(f"{ref.kind} {ref.path}: metadata {k} must be a positive number, got {v!r}")
    if ref.kind == "image":
        return MediaInfo("image", width=int(o["width"]), height=int(o["height"]), num_frames=1)
    n, dur = int(o["num_frames"]), float(o["duration"])
    return MediaInfo("video", width=int(o["width"]), height=int(o["height"]), duration=dur, fps=n / dur,
                     num_frames=n)


def _info(ref: MediaRef, cache: ProbeCache) -> MediaInfo:
    """The row's stated metadata (the file must exist), else a (cached) probe."""
    given = given_info(ref)
    if given is None:
        return probe_media(ref, cache)
    if ref.is_local and not os.path.isfile(ref.path):
        return MediaInfo(ref.kind, error="file not found")
    return given


def vision_flops(segments: list[int], dims: ModelDims) -> float:
    """Forward FLOPs of the vision tower + projector over attention segments of the given patch counts."""
    d, m, L = dims.vision_hidden, dims.vision_mlp, dims.vision_layers
    patch_in = 3 * dims.patch_size * dims.patch_size
    merged_in = d * dims.merge_size**2
    total = 0.0
    for p in segments:
        total += 2.0 * p * patch_in * d + L * (8.0 * p * d * d + 4.0 * p * p * d + 4.0 * p * d * m)
        n = p / dims.merge_size**2
        total += 2.0 * n * (merged_in * merged_in + merged_in * dims.llm_hidden)
    return total


def llm_flops(seq_len: int, dims: ModelDims) -> float:
    """Forward FLOPs of the language model (incl. LM head) on one causal sequence of ``seq_len`` tokens."""
    s, D, hd = float(seq_len), dims.llm_hidden, dims.llm_head_dim
    H, KV, I = dims.llm_heads, dims.llm_kv_heads, dims.llm_mlp  # noqa: E741 - the usual symbol
    per_layer = 2 * s * D * (H + 2 * KV) * hd + 2 * s * H * hd * D + 6 * s * D * I + 2 * s * s * H * hd
    return dims.llm_layers * per_layer + 2 * s * D * dims.vocab_size


@dataclass(frozen=True)
class SampleCost:
    """Cost of one sample.

    Attributes:
        tokens: exact LLM sequence length the processor produces (``input_ids.shape[1]``).
        text_tokens: tokens from the rendered chat text (incl. special tokens of the template).
        media_tokens: tokens the media expand to (placeholders, and for 1.5 frame/timestamp/fast markers).
        segments: vision-tower attention segments, in patches.
        vision_flops, llm_flops: forward FLOPs (see module docstring).
    """

    tokens: int
    text_tokens: int
    media_tokens: int
    segments: tuple[int, ...] = field(default_factory=tuple)
    vision_flops: float = 0.0
    llm_flops: float = 0.0

    @property
    def flops(self) -> float:
        """Total forward FLOPs (vision + LLM): the balancing cost."""
        return self.vision_flops + self.llm_flops

    @property
    def patches(self) -> int:
        """Vision patches (rows of ``pixel_values`` / ``pixel_values_videos``)."""
        return int(sum(self.segments))


class CostModel:
    """Exact tokens and FLOPs of manifest samples for one processor (see module docstring).

    Args:
        processor: a :class:`keye.processing.processor.KeyeProcessor`.
        dims: model sizes for FLOPs (default Keye-VL-8B).
        cache: probe cache (default: the user cache).
        mode: the thinking mode passed to the processor (``None``, ``"think"``, ...), as the loader does.
        slowfast_exact: 1.5 only; decode sampled frames once per video to classify slow/fast frames.
    """

    def __init__(
        self,
        processor: Any,
        dims: ModelDims | None = None,
        cache: ProbeCache | None = None,
        *,
        mode: str | None = None,
        slowfast_exact: bool = True,
    ):
        self.processor = processor
        self.dims = dims or ModelDims()
        self.cache = cache if cache is not None else ProbeCache()
        self.mode = mode
        self.slowfast_exact = slowfast_exact
        self.variant = processor.variant
        self._ts_tokens: dict[str, int] = {}  # timestamp text -> tokens (a few thousand distinct strings)

    @classmethod
    def from_processor(cls, processor: Any, *, cache: ProbeCache | None = None, **kw: Any) -> CostModel:
        """Default cost model for ``processor`` (Keye-VL-8B dims)."""
        return cls(processor, cache=cache, **kw)

    # ------------------------------------------------------------------ text
    def text_pieces(self, messages: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
        """(text pieces between placeholders, placeholder kinds) of the training rendering."""
        from keye.processing.chat import apply_mode, validate_messages

        conv = apply_mode(validate_messages(messages), self.mode)
        rendered = self.processor.chat_template.render(conv, False, False)
        pieces, kinds, pos = [], [], 0
        for m in _PLACEHOLDER.finditer(rendered):
            pieces.append(rendered[pos : m.start()])
            kinds.append("image" if m.group(0) == "<|image_pad|>" else "video")
            pos = m.end()
        pieces.append(rendered[pos:])
        return pieces, kinds

    def _n_text(self, text: str) -> int:
        if not text:
            return 0
        return len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ media
    def image_tokens(self, ref: MediaRef) -> tuple[int, list[int]]:
        """(LLM tokens, [patches]) of one image item."""
        from keye.processing.image import image_grid_for_size

        info = _info(ref, self.cache)
        if not info.ok:
            raise KeyeInputError(info.error or "unusable image", path=ref.path)
        o = ref.options
        t, h, w = image_grid_for_size(
            info.height,
            info.width,
            self.variant,
            min_pixels=o.get("min_pixels"),
            max_pixels=o.get("max_pixels"),
            resized_height=o.get("resized_height"),
            resized_width=o.get("resized_width"),
            processor_config=self.processor.image_processor.config,
        )
        merge = self.processor.image_processor.config.merge_size
        return t * h * w // (merge * merge), [t * h * w]

    def _timing(self, path: str, given: MediaInfo | None = None) -> tuple[np.ndarray, float, int, int]:
        """(true frame times in s, average fps, height, width) exactly as the processor's probe computes
        them, cached compactly (an arithmetic pts sequence is stored as its step); from the row's metadata
        (evenly spaced frames) when it states them."""
        if given is not None:
            return np.arange(given.num_frames) / given.fps, given.fps, given.height, given.width
        key = ProbeCache.file_key(f"vtiming{_TIMING_VERSION}", path)
        hit = self.cache.get(key) if key is not None else None
        if hit is None:
            from keye.processing.video import probe_video

            pr = probe_video(path)
            d = (pr.pts - pr.pts[0]).astype(np.int64)
            step = int(d[1]) if len(d) > 1 else 0
            arithmetic = bool(np.array_equal(d, np.arange(len(d), dtype=np.int64) * step))
            hit = {
                "n": len(d),
                "step": step if arithmetic else None,
                "dpts": None if arithmetic else d.tolist(),
                "tb": pr.time_base,
                "fps": pr.fps,
                "h": pr.height,
                "w": pr.width,
            }
            if key is not None:
                self.cache.put(key, hit)
        d = (
            np.arange(hit["n"], dtype=np.int64) * int(hit["step"])
            if hit["step"] is not None
            else np.asarray(hit["dpts"], dtype=np.int64)
        )
        return d * float(hit["tb"]), float(hit["fps"]), int(hit["h"]), int(hit["w"])

    def _frame_types(self, ref: MediaRef, opts: Any) -> tuple[np.ndarray, list[float] | None, int, int]:
        """1.5: (slow/fast types, timestamps, height, width) of the sampled frames, via one real decode."""
        from keye.processing.slowfast import classify_frames
        from keye.processing.video import fetch_video

        src: Any = list(ref.frames) if ref.frames is not None else ref.path
        opt_key = repr(sorted((k, v) for k, v in ref.options.items()))
        key = ProbeCache.file_key(f"vtypes{_TYPES_VERSION}:{opt_key}", ref.frames[-1] if ref.frames else ref.path)
        if ref.frames is not None and key is not None:
            key += "|" + "|".join(ref.frames)
        hit = self.cache.get(key) if key is not None else None
        if hit is None:
            video = fetch_video(src, opts, self.variant, backend=self.processor.video_backend, item=ref.path)
            n, h, w = video.frames.shape[0], video.frames.shape[1], video.frames.shape[2]
            if opts.slow_fast:
                import torch

                types = classify_frames(torch.from_numpy(video.frames).permute(0, 3, 1, 2), opts.min_frame_similarity)
            else:
                types = np.zeros(n, np.int32)
            hit = {"types": [int(t) for t in types], "ts": video.timestamps, "h": int(h), "w": int(w)}
            if key is not None:
                self.cache.put(key, hit)
        return np.asarray(hit["types"], np.int32), hit["ts"], hit["h"], hit["w"]

    def video_tokens(self, ref: MediaRef) -> tuple[int, list[int]]:
        """(LLM tokens incl. 1.5 frame markers/timestamps, attention segments in patches) of one video."""
        from keye.processing.video import VideoOptions, preview_video_size, sample_frames

        # The processor's own merge of checkpoint video_defaults and the item's options (stand-in
        # processors without checkpoint defaults take the item's options as they are).
        merge = getattr(self.processor, "video_options", None)
        opts = merge(ref.options, item=ref.path) if merge else VideoOptions.from_item(ref.options, item=ref.path)
        ip = self.processor.image_processor
        patch, merge = ip.config.patch_size, ip.config.merge_size
        if self.variant == "preview":
            if ref.frames is not None:
                return self._preview_frame_list(ref, opts)
            ts, fps, h, w = self._timing(ref.path, given_info(ref))
            plan = sample_frames(ts, fps, opts, self.variant, item=ref.path, path=ref.path)
            rh, rw = preview_video_size(h, w, plan.n_frames, opts, item=ref.path, path=ref.path)
            th, tw = ip.target_size(rh, rw)
            per_frame = (th // patch) * (tw // patch)
            return plan.n_frames * per_frame // (merge * merge), [plan.n_frames * per_frame]
        return self._v15_video(ref, opts)

    def _preview_frame_list(self, ref: MediaRef, opts: Any) -> tuple[int, list[int]]:
        from keye.processing.image import FETCH_MAX_PIXELS, FETCH_MIN_PIXELS, image_grid_for_size

        info = probe_media(ref, self.cache)
        if not info.ok:
            raise KeyeInputError(info.error or "unusable video", path=ref.path)
        lo = opts.min_pixels or FETCH_MIN_PIXELS["preview"]
        hi = opts.max_pixels or FETCH_MAX_PIXELS["preview"]
        _, gh, gw = image_grid_for_size(
            info.height, info.width, "preview", min_pixels=lo, max_pixels=hi,
            resized_height=opts.resized_height, resized_width=opts.resized_width,
            processor_config=self.processor.image_processor.config,
        )
        n = info.num_frames + info.num_frames % 2  # padded to even by repeating the last frame
        merge = self.processor.image_processor.config.merge_size
        return n * gh * gw // (merge * merge), [n * gh * gw]

    def _v15_video(self, ref: MediaRef, opts: Any) -> tuple[int, list[int]]:
        from keye.processing.slowfast import FAST, slowfast_sizes
        from keye.processing.video import sample_frames

        if self.slowfast_exact:
            types, ts, h, w = self._frame_types(ref, opts)
        else:
            if ref.frames is not None:
                info = probe_media(ref, self.cache)
                if not info.ok:
                    raise KeyeInputError(info.error or "unusable video", path=ref.path)
                fps = opts.fps or 2.0
                plan = sample_frames(np.arange(info.num_frames) / fps, fps, opts, self.variant, item=ref.path)
                h, w = info.height, info.width
                ts = plan.timestamps if opts.fps is not None else None
            else:
                times, fps, h, w = self._timing(ref.path, given_info(ref))
                plan = sample_frames(times, fps, opts, self.variant, item=ref.path, path=ref.path)
                ts = plan.timestamps
            types = np.zeros(plan.n_frames, np.int32)
        n_fast = int((types == FAST).sum())
        sizes = slowfast_sizes(
            len(types) - n_fast, n_fast, h, w,
            min_pixels=opts.min_pixels, max_pixels=opts.max_pixels, total_pixels=opts.total_pixels,
            floor_pixels=opts.floor_pixels, item=ref.path,
        )
        if opts.resized_height is not None:
            sizes = sizes.with_slow_size(opts.resized_height, opts.resized_width)
        patch = self.processor.image_processor.config.patch_size
        merge = self.processor.image_processor.config.merge_size
        slow_p = (sizes.slow_hw[0] // patch) * (sizes.slow_hw[1] // patch)
        fast_p = (sizes.fast_hw[0] // patch) * (sizes.fast_hw[1] // patch)
        tokens, segments = 0, []
        for t in types:
            p = fast_p if t == FAST else slow_p
            segments.append(p)
            tokens += 1 + p // (merge * merge) + (2 if t == FAST else 0)  # <|frame|> [+ fast markers]
        if ts is not None:
            tokens += self._timestamp_tokens([format(ts[j], ".1f") for j in range(len(types))])
        return tokens, segments

    def _timestamp_tokens(self, texts: list[str]) -> int:
        """Total tokens of the timestamp texts, each distinct string tokenised once (then remembered)."""
        new = sorted({t for t in texts if t not in self._ts_tokens})
        if new:
            ids = self.processor.tokenizer(new, add_special_tokens=False)["input_ids"]
            self._ts_tokens.update((t, len(x)) for t, x in zip(new, ids))
        return sum(self._ts_tokens[t] for t in texts)

    # ------------------------------------------------------------------ public
    def estimate(self, sample: Sample) -> SampleCost:
        """Cost of one manifest sample.

        Raises:
            KeyeInputError: a media file is missing / corrupt / unsupported, or the processor's sizing
                rules reject it (aspect ratio, clip too short, budget too small).
        """
        refs = sample.media
        for ref in refs:
            info = _info(ref, self.cache)
            if not info.ok:
                raise KeyeInputError(f"{ref.kind} {ref.path}: {info.error}", item=sample.id)
        pieces, kinds = self.text_pieces(sample.messages)
        if len(kinds) != len(refs) or any(k != r.kind for k, r in zip(kinds, refs)):
            raise KeyeInputError("text contains literal <|image_pad|>/<|video_pad|> tokens", item=sample.id)
        text = sum(self._n_text(p) for p in pieces)
        media, segments = 0, []
        for ref in refs:
            n, seg = self.image_tokens(ref) if ref.kind == "image" else self.video_tokens(ref)
            media += n
            segments += seg
        total = text + media
        return SampleCost(
            total, text, media, tuple(segments), vision_flops(segments, self.dims), llm_flops(total, self.dims)
        )


_JOB: tuple[Any, Any] | None = None  # (table, cost model) handed to forked estimation workers


def _estimate_chunk(shard: tuple[int, int]) -> Any:
    from keye.data.table import estimate_costs

    assert _JOB is not None
    return estimate_costs(_JOB[0], _JOB[1], shard=shard)


def estimate_parallel(table: Any, cost_model: Any, *, shard: tuple[int, int] = (0, 1), workers: int = 0,
                      progress: bool = False) -> tuple[Any, list[Any]]:
    """:func:`keye.data.table.estimate_costs` of the samples ``i % n == k`` (``shard=(k, n)``) of a
    :class:`~keye.data.table.SampleTable`, split over ``workers`` forked processes (0 or 1: in this process).

    Each worker takes interleaved slices of the shard (so slow and fast rows spread evenly) and reads its
    samples from the table itself; probes land in the shared on-disk probe cache. The result equals the
    one-process result: the same cost columns and the same rejected rows (ordered by line).
    """
    from keye.data.table import estimate_costs, merge_costs

    if workers <= 1:
        return estimate_costs(table, cost_model, shard=shard, progress=progress)
    global _JOB
    k, n = shard
    chunks = workers * 4
    subs = [(k + n * j, n * chunks) for j in range(chunks)]
    _JOB = (table, cost_model)
    try:
        # fork: the table and the cost model (a tokenizer, a processor) reach the workers without pickling.
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            parts = pool.imap_unordered(_estimate_chunk, subs)
            if progress:
                from tqdm.auto import tqdm

                parts = tqdm(parts, total=len(subs), desc="estimating costs", unit="slice")
            done = list(parts)
    finally:
        _JOB = None
    bad = sorted((b for _, part_bad in done for b in part_bad), key=lambda b: b.line)
    return merge_costs([cols for cols, _ in done]), bad
