"""Video decoding (PyAV / decord / torchcodec), frame sampling and preview resizing (architecture.md §9-10.2).

Decoding is split in two steps so only the sampled frames are ever decoded:

1. :func:`probe_video` demuxes the container with PyAV (no decoding) to get every frame's true
   presentation time, the keyframes and the average frame rate;
2. :func:`sample_frames` picks frame indices with the preview or 1.5 rules (time ranges and
   variable-frame-rate files included), and a backend decodes just those, seeking to the nearest
   keyframe before each one.

Backends: ``"pyav"`` (always present), ``"decord"`` (pip ``decord2``) and ``"torchcodec"`` when they import.
The choice is the ``backend`` argument, else the ``KEYE_VIDEO_BACKEND`` environment variable, else the
first usable of pyav, decord, torchcodec (PyAV first: always installed, and the fastest seek path in
``benchmarks/video.py``); when a backend fails the next usable one is tried, with one logged warning.
Clips shorter than one sampling step are valid videos (see :func:`sample_frames`); ``docs/video.md``
describes the whole procedure for users.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from keye.errors import KeyeInputError
from keye.processing.image import (
    FETCH_MAX_PIXELS,
    FETCH_MIN_PIXELS,
    IMAGE_FACTOR,
    PREVIEW,
    V1_5,
    fetch_image,
    read_source_bytes,
    smart_resize,
)
from keye.processing.slowfast import (
    MIN_FRAME_SIMILARITY,
    VIDEO_MAX_PIXELS,
    VIDEO_MIN_PIXELS,
    max_frames_for_budget,
)

logger = logging.getLogger(__name__)

BACKENDS = ("pyav", "decord", "torchcodec")
ENV_BACKEND = "KEYE_VIDEO_BACKEND"

# Preview constants (keye-vl-utils 1.0.0, §9.1).
FRAME_FACTOR = 2
FPS = 2.0
FPS_MIN_FRAMES = 4
FPS_MAX_FRAMES = 768
PREVIEW_VIDEO_MIN_PIXELS = 128 * 28 * 28
PREVIEW_VIDEO_MAX_PIXELS = 768 * 28 * 28
PREVIEW_VIDEO_TOTAL_PIXELS = int(float(os.environ.get("VIDEO_MAX_PIXELS", 128000 * 28 * 28 * 0.9)))
CFR_TOLERANCE = 0.05  # relative spread of frame durations below which a file counts as constant-rate


# ----------------------------------------------------------------------------------------------------------
# Options


@dataclass
class VideoOptions:
    """Per-item video options of the message schema (keye-vl-utils keys). None means "the default".

    Times are in seconds, pixel counts in pixels. ``slow_fast``/``min_frame_similarity`` apply to 1.5.
    The whole-video pixel budget has two names: ``video_total_pixels`` (the key keye-vl-utils 1.5.2 reads)
    and ``total_pixels`` (the preview's key); :meth:`from_item` folds the first into the second.
    """

    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None
    video_total_pixels: int | None = None
    video_start: float | None = None
    video_end: float | None = None
    resized_height: int | None = None
    resized_width: int | None = None
    slow_fast: bool = True
    min_frame_similarity: float = MIN_FRAME_SIMILARITY
    # Smallest 1.5 frame size in pixels (the reference's 37,632 when None). Checkpoints set it through
    # ``video_defaults`` in preprocessor_config.json (keye-tiny uses small frames to run on a CPU).
    floor_pixels: int | None = None

    @classmethod
    def from_item(cls, content: dict[str, Any] | None, item: Any = None) -> VideoOptions:
        """Read and validate the options of one ``{"type": "video", ...}`` content item (other keys are
        ignored).

        Raises :class:`KeyeInputError` naming ``item`` for non-positive fps / frame counts / pixel
        budgets, a time range with ``video_end <= video_start``, only one of ``resized_height/width``, or
        ``total_pixels`` and ``video_total_pixels`` both given with different values.
        """
        d = dict(content or {})
        names = cls.__dataclass_fields__
        opts = cls(**{k: d[k] for k in names if k in d and d[k] is not None})

        def bad(msg: str) -> KeyeInputError:
            return KeyeInputError(msg, item=item)

        for name in (
            "fps",
            "nframes",
            "min_frames",
            "max_frames",
            "min_pixels",
            "max_pixels",
            "total_pixels",
            "video_total_pixels",
            "floor_pixels",
        ):
            v = getattr(opts, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise bad(f"video option {name} must be a positive number, got {v!r}")
        for name in ("video_start", "video_end"):
            v = getattr(opts, name)
            if v is not None and (not isinstance(v, (int, float)) or v < 0):
                raise bad(f"video option {name} must be a non-negative number of seconds, got {v!r}")
        if opts.video_start is not None and opts.video_end is not None and opts.video_end <= opts.video_start:
            raise bad(f"video_end ({opts.video_end}) must be after video_start ({opts.video_start})")
        if opts.video_total_pixels is not None:
            if opts.total_pixels is not None and opts.total_pixels != opts.video_total_pixels:
                raise bad(
                    f"total_pixels ({opts.total_pixels}) and video_total_pixels ({opts.video_total_pixels}) "
                    "name the same budget; give one"
                )
            opts.total_pixels = opts.video_total_pixels
        if (opts.resized_height is None) != (opts.resized_width is None):
            raise bad("give both resized_height and resized_width, or neither")
        if not 0.0 <= opts.min_frame_similarity <= 1.0:
            raise bad(f"min_frame_similarity must be in [0, 1], got {opts.min_frame_similarity}")
        if opts.min_pixels and opts.max_pixels and opts.min_pixels > opts.max_pixels:
            raise bad(f"min_pixels ({opts.min_pixels}) exceeds max_pixels ({opts.max_pixels})")
        return opts


# ----------------------------------------------------------------------------------------------------------
# Probe and sampling (pure)


@dataclass
class VideoProbe:
    """Container facts: per-frame presentation times (s, first frame = 0, presentation order), keyframe
    flags, average frame rate, frame size, and the raw pts/time base used for seeking."""

    path: str
    timestamps: np.ndarray
    keyframes: np.ndarray
    fps: float
    height: int
    width: int
    pts: np.ndarray
    time_base: float

    @property
    def n_frames(self) -> int:
        """Number of frames in the stream."""
        return len(self.timestamps)

    @property
    def duration(self) -> float:
        """Seconds covered by the frames (last timestamp + one average frame duration)."""
        return float(self.timestamps[-1]) + 1.0 / self.fps if self.n_frames else 0.0


def is_constant_rate(timestamps: np.ndarray) -> bool:
    """True when every frame duration is within 5 % of the median (or there are < 3 frames)."""
    if len(timestamps) < 3:
        return True
    d = np.diff(timestamps)
    med = float(np.median(d))
    return med > 0 and float(np.abs(d - med).max()) <= CFR_TOLERANCE * med


@dataclass
class VideoPlan:
    """Result of :func:`plan_video` / :func:`sample_frames`.

    ``indices`` into the source frames; ``timestamps`` (s) of those frames; ``sample_fps`` = frames per
    second of the sample (preview: ``n / total * video_fps``); for the preview also the resized frame size
    ``resized_hw``, the per-frame grid ``frame_grid`` = [1, h/14, w/14] and LLM tokens. For 1.5 the sizes
    depend on the slow/fast split: see :func:`keye.processing.slowfast.slowfast_sizes`.
    """

    indices: list[int]
    timestamps: list[float] | None
    sample_fps: float
    resized_hw: tuple[int, int] | None = None

    @property
    def n_frames(self) -> int:
        """Number of sampled frames."""
        return len(self.indices)

    @property
    def frame_grid(self) -> list[int] | None:
        """Per-frame grid [1, h, w] in 14-pixel patches (preview only)."""
        return None if self.resized_hw is None else [1, self.resized_hw[0] // 14, self.resized_hw[1] // 14]

    @property
    def tokens_per_frame(self) -> int | None:
        """LLM tokens per frame (preview only)."""
        g = self.frame_grid
        return None if g is None else g[1] * g[2] // 4

    @property
    def total_tokens(self) -> int | None:
        """LLM tokens of the whole video (preview only; 1.5 needs the slow/fast split)."""
        t = self.tokens_per_frame
        return None if t is None else t * self.n_frames


def _round_by(x: float, f: int) -> int:
    return int(round(x / f) * f)


def _ceil_by(x: float, f: int) -> int:
    return int(math.ceil(x / f) * f)


def _floor_by(x: float, f: int) -> int:
    return int(math.floor(x / f) * f)


def _frame_range(ts: np.ndarray, opts: VideoOptions, item: Any, path: Any) -> tuple[int, int]:
    """First/last frame index inside [video_start, video_end] using true timestamps (one frame is enough)."""
    n = len(ts)
    if opts.video_start is None and opts.video_end is None:
        return 0, n - 1
    eps = 1e-6
    start = 0 if opts.video_start is None else int(np.searchsorted(ts, opts.video_start - eps, side="left"))
    end = (
        n - 1 if opts.video_end is None else int(np.searchsorted(ts, opts.video_end + eps, side="right")) - 1
    )
    if start >= n or end < start:
        raise KeyeInputError(
            f"time range [{opts.video_start}, {opts.video_end}] s holds no frame of a "
            f"{float(ts[-1]):.2f} s video",
            item=item,
            path=path,
        )
    return start, end


def _preview_nframes(opts: VideoOptions, total: int, video_fps: float, item: Any, path: Any) -> int:
    if opts.nframes is not None:
        n = _round_by(opts.nframes, FRAME_FACTOR)
    else:
        fps = opts.fps or FPS
        min_f = _ceil_by(opts.min_frames or FPS_MIN_FRAMES, FRAME_FACTOR)
        max_f = _floor_by(opts.max_frames or min(FPS_MAX_FRAMES, total), FRAME_FACTOR)
        n = total / video_fps * fps
        n = min(min(max(n, min_f), max_f), total)
        n = _floor_by(n, FRAME_FACTOR)
    if total < FRAME_FACTOR:
        # A clip shorter than one temporal patch is still a video: take what exists, and
        # sample_frames repeats the last frame up to FRAME_FACTOR.
        return total
    if n > total:
        raise KeyeInputError(
            f"nframes={opts.nframes or n} exceeds the {total} frames in the clip / time range",
            item=item,
            path=path,
        )
    if n < FRAME_FACTOR:
        raise KeyeInputError(
            f"the options give {n} frames (nframes={opts.nframes}, max_frames={opts.max_frames}); the preview "
            f"needs at least {FRAME_FACTOR}",
            item=item,
            path=path,
        )
    return n


def _v15_nframes(
    opts: VideoOptions, total: int, video_fps: float, seconds: float, item: Any, path: Any
) -> int:
    if opts.nframes is not None:
        n = min(int(opts.nframes), total)
    else:
        fps = min(opts.fps or FPS, video_fps)
        max_frames = max_frames_for_budget(opts.min_pixels, opts.total_pixels, opts.floor_pixels)
        if opts.max_frames is not None:
            max_frames = min(max_frames, int(opts.max_frames))
        n = min(int(seconds * fps), max_frames, total)
    # keye-vl-utils 1.5.2 samples 0 frames from a clip shorter than 1/fps and then fails (IndexError);
    # such a clip is still a video, so it gets its first frame.
    return max(n, 1)


def sample_frames(
    timestamps: np.ndarray,
    video_fps: float,
    opts: VideoOptions,
    variant: str,
    item: Any = None,
    path: Any = None,
) -> VideoPlan:
    """Pick the frames to decode from a video whose frames play at ``timestamps`` (s, ascending).

    Preview: ``smart_nframes`` (§9.3: FRAME_FACTOR 2, 4..768 frames, fps 2); 1.5: ``int(seconds * fps)``
    capped by the budget's max frames (§10.2). Constant-rate files use the reference's
    ``torch.linspace(start, end, n).round()`` (float32) over indices; variable-rate files take, for each of ``n``
    evenly spaced times, the frame shown at the nearest timestamp.

    Short clips are valid: 1.5 takes at least one frame (a clip shorter than ``1/fps`` gives its first
    frame), and the preview, whose frames pair up in temporal patches of ``FRAME_FACTOR`` = 2, takes every
    frame of a one-frame clip and repeats the last index to fill the patch. Raises
    :class:`KeyeInputError` for an empty video or a time range holding no frame.
    """
    ts = np.asarray(timestamps, dtype=np.float64)
    if len(ts) == 0:
        raise KeyeInputError("video has zero decodable frames", item=item, path=path)
    if not video_fps or video_fps <= 0 or not math.isfinite(video_fps):
        raise KeyeInputError(f"video reports an invalid frame rate ({video_fps})", item=item, path=path)
    start, end = _frame_range(ts, opts, item, path)
    total = end - start + 1
    cfr = is_constant_rate(ts)
    seconds = total / video_fps if cfr else float(ts[end] - ts[start]) + 1.0 / video_fps
    # Constant rate: the container's rate, so the counts are the reference's to the last bit. Variable
    # rate: the rate the range really plays at.
    range_fps = video_fps if cfr else total / seconds
    if variant == PREVIEW:
        n = _preview_nframes(opts, total, range_fps, item, path)
    else:
        n = _v15_nframes(opts, total, video_fps, seconds, item, path)
    if cfr:
        # torch's float32 linspace, as the reference: numpy's float64 one rounds some .5 ties the other way
        # (linspace(0, 29, 15)[7] is 14.5 in float32 -> 14, 14.500000000000002 in float64 -> 15).
        idx = torch.linspace(start, end, n).round().long().numpy()
    else:
        targets = np.linspace(ts[start], ts[end], n)
        right = np.clip(np.searchsorted(ts, targets), start, end)
        left = np.clip(right - 1, start, end)
        idx = np.where(np.abs(ts[left] - targets) <= np.abs(ts[right] - targets), left, right)
    sample_fps = n / total * range_fps
    if variant == PREVIEW and n % FRAME_FACTOR:
        idx = np.concatenate([idx, np.repeat(idx[-1:], FRAME_FACTOR - n % FRAME_FACTOR)])
    return VideoPlan([int(i) for i in idx], [float(ts[i]) for i in idx], float(sample_fps))


def preview_video_size(
    height: int, width: int, n_frames: int, opts: VideoOptions, item: Any = None, path: Any = None
) -> tuple[int, int]:
    """Preview per-frame resize target (§9.4): the per-frame pixel cap shrinks with the frame count."""
    min_pixels = opts.min_pixels or PREVIEW_VIDEO_MIN_PIXELS
    total_pixels = opts.total_pixels or PREVIEW_VIDEO_TOTAL_PIXELS
    max_pixels = max(
        min(PREVIEW_VIDEO_MAX_PIXELS, total_pixels / n_frames * FRAME_FACTOR), int(min_pixels * 1.05)
    )
    if opts.max_pixels is not None:
        max_pixels = min(opts.max_pixels, max_pixels)
    if opts.resized_height is not None:
        return smart_resize(
            int(opts.resized_height), int(opts.resized_width), IMAGE_FACTOR, item=item, path=path
        )
    return smart_resize(height, width, IMAGE_FACTOR, min_pixels, max_pixels, item=item, path=path)


def plan_video(
    n_frames: int | None,
    fps: float,
    height: int,
    width: int,
    variant: str = PREVIEW,
    options: VideoOptions | dict[str, Any] | None = None,
    *,
    duration: float | None = None,
    timestamps: Any = None,
) -> VideoPlan:
    """Sampling plan of a video from its metadata alone (no decoding), for cost models.

    Give ``n_frames`` and ``fps`` (constant rate), or ``duration`` and ``fps`` (``n_frames`` derived), or
    the true per-frame ``timestamps``. Returns the sampled indices/timestamps, ``sample_fps`` and, for the
    preview, the resized size / per-frame grid / tokens. For 1.5 combine ``plan.n_frames`` with
    :func:`keye.processing.slowfast.slowfast_sizes`.
    """
    opts = options if isinstance(options, VideoOptions) else VideoOptions.from_item(options)
    if timestamps is not None:
        ts = np.asarray(timestamps, dtype=np.float64)
    else:
        if n_frames is None:
            if duration is None:
                raise KeyeInputError("plan_video needs n_frames, duration or timestamps")
            n_frames = int(round(duration * fps))
        ts = np.arange(int(n_frames), dtype=np.float64) / fps
    plan = sample_frames(ts, fps, opts, variant)
    if variant == PREVIEW:
        plan.resized_hw = preview_video_size(height, width, plan.n_frames, opts)
    return plan


# ----------------------------------------------------------------------------------------------------------
# Probe (PyAV demux only)


def _av_error_types() -> tuple[type[BaseException], ...]:
    import av

    return (av.error.FFmpegError, OSError, ValueError, IndexError, RuntimeError, StopIteration)


def probe_video(path: str, item: Any = None) -> VideoProbe:
    """Read every frame's pts and keyframe flag by demuxing (no decoding) with PyAV.

    Raises :class:`KeyeInputError` for a missing / unreadable file, a file without a video stream or
    without any frame.
    """
    import av

    if not os.path.isfile(path):
        raise KeyeInputError("video file not found", item=item, path=path)
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise KeyeInputError("file has no video stream", item=item, path=path)
            stream = container.streams.video[0]
            tb = float(stream.time_base)
            pts, keys = [], []
            for packet in container.demux(stream):
                if packet.pts is None or packet.size == 0:
                    continue
                pts.append(packet.pts)
                keys.append(packet.is_keyframe)
            rate = stream.average_rate or stream.guessed_rate
            height, width = stream.codec_context.height, stream.codec_context.width
    except KeyeInputError:
        raise
    except _av_error_types() as err:
        raise KeyeInputError(
            f"unreadable, truncated or corrupt video ({err.__class__.__name__}: {err})", item=item, path=path
        ) from err
    if not pts:
        raise KeyeInputError("video has zero decodable frames", item=item, path=path)
    order = np.argsort(np.asarray(pts), kind="stable")
    pts_arr = np.asarray(pts, dtype=np.int64)[order]
    key_arr = np.asarray(keys, dtype=bool)[order]
    ts = (pts_arr - pts_arr[0]) * tb
    fps = float(rate) if rate else 0.0
    if fps <= 0 and len(ts) > 1 and ts[-1] > 0:
        fps = (len(ts) - 1) / float(ts[-1])
    if not width or not height:
        raise KeyeInputError("video stream reports no frame size", item=item, path=path)
    return VideoProbe(path, ts, key_arr, fps or FPS, int(height), int(width), pts_arr, tb)


# ----------------------------------------------------------------------------------------------------------
# Backends


@functools.lru_cache(maxsize=1)
def _torchcodec_usable() -> bool:
    """torchcodec imports without FFmpeg but fails on first use; probe that once."""
    if importlib.util.find_spec("torchcodec") is None:
        return False
    try:
        from torchcodec.decoders import VideoDecoder

        VideoDecoder(b"not a video")
    except RuntimeError as err:
        return "load libtorchcodec" not in str(err)
    except Exception:  # any other complaint is about the (deliberately bad) input: the library works
        return True
    return True


def available_backends() -> list[str]:
    """Backends usable here, in automatic-choice order (pyav first; it is always present)."""
    out = ["pyav"]
    if importlib.util.find_spec("decord") is not None:
        out.append("decord")
    if _torchcodec_usable():
        out.append("torchcodec")
    return out


def _decode_pyav(probe: VideoProbe, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Seek-decode ``indices`` with PyAV: seek to the keyframe before a target unless the decoder can
    reach it without passing another keyframe, then decode forward to the target's pts."""
    import av

    wanted = sorted(set(indices))
    key_pts = probe.pts[probe.keyframes]
    key_idx = np.flatnonzero(probe.keyframes)
    frames: dict[int, np.ndarray] = {}
    times: dict[int, float] = {}
    # Frame threading pays off on long decode runs but costs a pipeline refill (about one frame per
    # thread) after every seek: use it only when each target needs many frames decoded.
    before = (
        key_idx[np.clip(np.searchsorted(key_idx, wanted, side="right") - 1, 0, None)] if len(key_idx) else [0]
    )
    run = float(np.mean(np.asarray(wanted) - np.asarray(before))) + 1 if len(key_idx) else float(len(wanted))
    with av.open(probe.path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO" if run > 4 * (os.cpu_count() or 1) else "NONE"
        decoder = None
        last_pts = None
        for i in wanted:
            target = int(probe.pts[i])
            k = key_pts[key_pts <= target]
            key = int(k[-1]) if len(k) else int(probe.pts[0])
            if decoder is None or last_pts is None or last_pts >= target or last_pts < key:
                container.seek(key, stream=stream, backward=True, any_frame=False)
                decoder = container.decode(stream)
            frame = None
            for frame in decoder:
                if frame.pts is None:
                    continue
                last_pts = frame.pts
                if frame.pts >= target:
                    break
            if frame is None or last_pts is None or last_pts < target:
                raise KeyeInputError(
                    f"frame {i} (pts {target}) could not be decoded; the file may be truncated"
                )
            # threads=1: swscale's automatic slice threads (FFmpeg 8 under PyAV 18) hung for good in
            # avpriv_slicethread_free inside a forked data-loader worker; loaders parallelise over worker
            # processes anyway, so one thread per conversion costs them nothing
            frames[i] = frame.to_ndarray(format="rgb24", threads=1)
            times[i] = (frame.pts - int(probe.pts[0])) * probe.time_base
    return np.stack([frames[i] for i in indices]), np.array([times[i] for i in indices])


def _decode_decord(probe: VideoProbe, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
    import decord

    vr = decord.VideoReader(probe.path, ctx=decord.cpu(0), num_threads=2)
    if len(vr) != probe.n_frames:
        raise KeyeInputError(f"decord sees {len(vr)} frames, the container {probe.n_frames}")
    frames = vr.get_batch(list(indices)).asnumpy()
    stamps = vr.get_frame_timestamp(list(range(len(vr))))[:, 0]
    times = stamps[list(indices)] - stamps[0]
    return frames, np.asarray(times, dtype=np.float64)


def _decode_torchcodec(probe: VideoProbe, indices: list[int]) -> tuple[np.ndarray, np.ndarray]:
    from torchcodec.decoders import VideoDecoder

    dec = VideoDecoder(probe.path, seek_mode="exact", dimension_order="NHWC")
    batch = dec.get_frames_at(indices=list(indices))
    first = dec.get_frames_at(indices=[0]).pts_seconds[0].item()
    return batch.data.numpy(), batch.pts_seconds.numpy().astype(np.float64) - first


_DECODERS = {"pyav": _decode_pyav, "decord": _decode_decord, "torchcodec": _decode_torchcodec}


def choose_backends(backend: str | None = None) -> list[str]:
    """Backends to try, in order: ``backend`` (or env ``KEYE_VIDEO_BACKEND``) first, then the other
    available ones. Raises :class:`KeyeInputError` for an unknown name or one that is not installed."""
    avail = available_backends()
    want = backend or os.environ.get(ENV_BACKEND) or None
    if want is None:
        return avail
    want = want.lower()
    if want not in _DECODERS:
        raise KeyeInputError(f"unknown video backend {want!r}; expected one of {list(BACKENDS)}")
    if want not in avail:
        raise KeyeInputError(f"video backend {want!r} is not installed (available: {avail})")
    return [want] + [b for b in avail if b != want]


def decode_frames(
    probe: VideoProbe, indices: list[int], backend: str | None = None, item: Any = None
) -> tuple[np.ndarray, np.ndarray, str]:
    """Decode only ``indices`` of a probed video. Returns (uint8 ``[n, H, W, 3]`` RGB frames, their
    timestamps in s as the backend reports them, the backend used). Falls back to the next backend when
    one fails, and then logs one warning (this module's logger) naming the file, the failed backend(s) and
    their errors; raises :class:`KeyeInputError` listing every failure if none succeeds."""
    errors = []
    for name in choose_backends(backend):
        try:
            frames, times = _DECODERS[name](probe, indices)
            if frames.shape[0] != len(indices) or frames.ndim != 4:
                raise KeyeInputError(f"{name} returned {frames.shape[0]} frames for {len(indices)} indices")
        except Exception as err:  # each backend has its own error classes; all mean "try the next"
            errors.append(f"{name}: {err.__class__.__name__}: {err}")
            continue
        if errors:
            # A silent fallback hides decoder bugs (decord fails on some small clips) and changes pixels
            # slightly between backends, so say which backend failed and why.
            logger.warning(
                "%s: video backend %s failed, decoded with %s instead (%s)",
                probe.path,
                " and ".join(e.split(":", 1)[0] for e in errors),
                name,
                "; ".join(errors),
            )
        return np.ascontiguousarray(frames), times, name
    raise KeyeInputError("cannot decode video (" + "; ".join(errors) + ")", item=item, path=probe.path)


# ----------------------------------------------------------------------------------------------------------
# fetch_video


@dataclass
class DecodedVideo:
    """Sampled frames of one video item, ready for the image processor.

    ``frames``: uint8 ``[n, H, W, 3]`` (preview: already resized per §9.4; 1.5: original size);
    ``timestamps`` (s) of the sampled frames or None (1.5 frame lists without ``fps``); for constant-rate
    sources these are keye-vl-utils' float32 ``(1 / fps) * index`` (the values whose ``.1f`` text goes
    into the 1.5 prompt), for variable-rate files the decoder's true times. ``presized``: the frames
    already have the item's ``resized_height``/``resized_width`` size (1.5 frame lists, as the reference).
    """

    frames: np.ndarray
    indices: list[int]
    timestamps: list[float] | None
    sample_fps: float
    video_fps: float | None
    total_frames: int
    backend: str | None
    source: str
    presized: bool = False


def official_timestamps(indices: list[int], fps: float) -> list[float]:
    """keye-vl-utils 1.5.2 frame times: ``float32((1 / fps) * i)`` for each index ``i``, as Python floats.

    The 1.5 prompt writes ``format(t, ".1f")`` of these float32 values; float64 times differ at ties
    (0.15 s is 0.1499... in float64 but 0.1500000060 in float32, so "0.1" against "0.2").
    """
    step = 1.0 / fps
    return [float(np.float32(step * i)) for i in indices]


def resize_bicubic_u8(frames: np.ndarray, size_hw: tuple[int, int]) -> np.ndarray:
    """torchvision-style BICUBIC antialiased resize of uint8 ``[n, H, W, 3]`` (float maths, clamp, round)."""
    if frames.shape[1:3] == tuple(size_hw):
        return frames
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    y = F.interpolate(x, size=tuple(size_hw), mode="bicubic", antialias=True, align_corners=False)
    return y.clamp_(0, 255).round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def _local_video(src: str | bytes, item: Any) -> tuple[str, str | None]:
    """(local path, temp file to delete) for a path / file:// / http(s):// / data: video source or the
    file's bytes."""
    if isinstance(src, bytes):
        data = src
    else:
        data, local = read_source_bytes(src, item, "video")
        if data is None:
            return local, None
    fd, tmp = tempfile.mkstemp(suffix=".mp4", prefix="keye_video_")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return tmp, tmp


def _frames_input(src: Any, opts: VideoOptions, variant: str, item: Any) -> DecodedVideo:
    """A list of frame images or a uint8 array [T, H, W, 3] (already sampled frames)."""
    if isinstance(src, (np.ndarray, torch.Tensor)):
        arr = src.detach().cpu().numpy() if isinstance(src, torch.Tensor) else src
        if arr.ndim != 4 or arr.shape[-1] != 3 or arr.dtype != np.uint8:
            raise KeyeInputError(
                f"video array must be uint8 [T,H,W,3], got {arr.dtype} {arr.shape}", item=item
            )
        frames = list(arr)
        kind = "array"
    else:
        if not src:
            raise KeyeInputError("video frame list is empty", item=item)
        if variant == PREVIEW:
            lo, hi = (
                opts.min_pixels or FETCH_MIN_PIXELS[PREVIEW],
                opts.max_pixels or FETCH_MAX_PIXELS[PREVIEW],
            )
        else:
            lo, hi = (
                opts.min_pixels or opts.floor_pixels or VIDEO_MIN_PIXELS,
                opts.max_pixels or VIDEO_MAX_PIXELS,
            )
        frames = [
            np.asarray(
                fetch_image(
                    f,
                    variant,
                    min_pixels=lo,
                    max_pixels=hi,
                    resized_height=opts.resized_height,
                    resized_width=opts.resized_width,
                    item=f"{item} frame {k}",
                )
            )
            for k, f in enumerate(src)
        ]
        kind = "frames"
    if len(frames) == 0:
        raise KeyeInputError("video has zero frames", item=item)
    shapes = {f.shape for f in frames}
    if len(shapes) > 1:
        raise KeyeInputError(f"video frames differ in size: {sorted(shapes)}", item=item)
    n = len(frames)
    fps = opts.fps or FPS
    if variant == PREVIEW:
        idx = list(range(n)) + [n - 1] * (_ceil_by(n, FRAME_FACTOR) - n)  # pad to even by repeating the last
        ts = [i / fps for i in idx]
        return DecodedVideo(np.stack([frames[i] for i in idx]), idx, ts, fps, fps, n, None, kind)
    plan = sample_frames(np.arange(n) / fps, fps, opts, V1_5, item)
    # 1.5 writes timestamps only when fps is known
    ts = official_timestamps(plan.indices, fps) if opts.fps is not None else None
    return DecodedVideo(
        np.stack([frames[i] for i in plan.indices]),
        plan.indices,
        ts,
        fps,
        fps,
        n,
        None,
        kind,
        presized=kind == "frames" and opts.resized_height is not None,
    )


def fetch_video(
    src: Any,
    opts: VideoOptions | None = None,
    variant: str = PREVIEW,
    backend: str | None = None,
    item: Any = None,
) -> DecodedVideo:
    """Load one video item: a path / ``file://`` / ``http(s)://`` / ``data:`` URI or the file's bytes (probe,
    sample, seek-decode), a list of frame images, or a uint8 array ``[T, H, W, 3]``.

    Preview file inputs are resized per §9.4 (bicubic, antialias); array inputs go to the image
    processor unchanged (as the reference processor receives them); 1.5 frames keep their size (the
    slow/fast sizes are decided later). Raises :class:`KeyeInputError` naming ``item`` and the file.
    """
    opts = opts or VideoOptions()
    if src is None:
        raise KeyeInputError("video item has no 'video' source", item=item)
    if isinstance(src, (list, tuple, np.ndarray, torch.Tensor)):
        return _frames_input(src, opts, variant, item)
    if isinstance(src, (bytes, bytearray, memoryview)):
        # keye-vl-utils takes a video file's bytes as well; they are decoded from a temporary file.
        data = bytes(src)
        path, tmp = _local_video(data, item)
        src = f"<{len(data)} bytes of video>"
    elif isinstance(src, (str, Path)):
        path, tmp = _local_video(str(src), item)
    else:
        raise KeyeInputError(f"unsupported video source of type {type(src).__name__}", item=item)
    try:
        probe = probe_video(path, item)
        plan = sample_frames(probe.timestamps, probe.fps, opts, variant, item, src)
        frames, times, used = decode_frames(probe, plan.indices, backend, item)
    finally:
        if tmp is not None:
            os.unlink(tmp)
    if variant == PREVIEW:
        size = preview_video_size(probe.height, probe.width, len(plan.indices), opts, item, src)
        frames = resize_bicubic_u8(frames, size)
    if is_constant_rate(probe.timestamps):
        stamps = official_timestamps(plan.indices, probe.fps)
    else:
        stamps = [float(t) for t in times]
    return DecodedVideo(
        frames,
        plan.indices,
        stamps,
        plan.sample_fps,
        probe.fps,
        probe.n_frames,
        used,
        str(src) if len(str(src)) < 200 else str(src)[:60] + "...",
    )
