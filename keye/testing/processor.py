"""Offline processor fixtures: a complete tiny processor directory and synthetic test videos.

``make_tiny_processor_dir`` writes everything ``KeyeProcessor.from_pretrained(dir)`` reads (tokenizer,
``preprocessor_config.json``, ``chat_template.json``). For ``variant="preview"`` the token ids match the
golden tiny model in ``tests/fixtures/golden/keye_preview_tiny`` (ordinary tokens ``[0, 480)``, Qwen added tokens
from 480, in the official order of architecture.md §11.1).

``make_test_video`` writes an H.264 file with PyAV whose frame index is written into the pixels as big
black/white bit cells, so any decoder's output can be checked with :func:`read_frame_index`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from keye.errors import KeyeConfigError

INDEX_BITS = 12


def make_tiny_processor_dir(
    out_dir: str | Path,
    variant: str = "preview",
    vocab_size: int | None = None,
    n_ordinary: int = 480,
) -> Path:
    """Write a tiny, fully offline processor directory for ``variant`` ("preview" or "1.5").

    Token ids: ordinary BPE tokens ``[0, n_ordinary)``, then the 32 Qwen added tokens
    (``<|endoftext|>`` = n_ordinary, ``<|im_start|>`` = +1, ``<|im_end|>`` = +2, ``<|vision_start|>`` = +9,
    ``<|image_pad|>`` = +12, ``<|video_pad|>`` = +13, ``<think>`` = +24, ``</think>`` = +25,
    ``<|clip_time_end|>`` = +31), then for 1.5 ``<|frame|>``, ``<|fast_start|>``, ``<|fast_end|>`` (+32..+34).
    ``vocab_size``, if given, is the embedding size of the model the processor will feed: a
    :class:`KeyeConfigError` is raised if the tokenizer does not fit in it.
    Returns the directory path.
    """
    from keye.processing.chat import OFFICIAL_CHAT_TEMPLATE
    from keye.processing.image import PREVIEW, check_variant
    from keye.processing.tokenizer import save_tokenizer, train_tiny_tokenizer

    check_variant(variant)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_tokenizer(n_ordinary=n_ordinary, variant=variant)
    if vocab_size is not None and tok.get_vocab_size() > vocab_size:
        raise KeyeConfigError(
            f"tokenizer has {tok.get_vocab_size()} tokens but the model vocab is {vocab_size}"
        )
    save_tokenizer(tok, out, variant)
    pre = {
        "min_pixels": 3136,
        "max_pixels": 1003520,
        "patch_size": 14,
        "temporal_patch_size": 1,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        # preview: the official file relies on the BICUBIC default; 1.5 follows the port's BILINEAR (§8.4).
        "processor_class": "KeyeProcessor" if variant == PREVIEW else "KeyeVL1_5Processor",
    }
    if variant != PREVIEW:
        pre["resample"] = 2
    (out / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": OFFICIAL_CHAT_TEMPLATE}, indent=2))
    return out


# ----------------------------------------------------------------------------------------------------------
# Test videos


@dataclass
class TestVideo:
    """What :func:`make_test_video` wrote: the path and every frame's presentation time in seconds."""

    path: Path
    timestamps: list[float]
    height: int
    width: int

    @property
    def n_frames(self) -> int:
        """Number of frames written."""
        return len(self.timestamps)


def _bit_cells(index: int, height: int, width: int, rows: int) -> np.ndarray:
    """A [rows_px, W] strip holding ``index`` as INDEX_BITS black/white cells (MSB first)."""
    strip = np.zeros((rows, width), np.uint8)
    edges = np.linspace(0, width, INDEX_BITS + 1).astype(int)
    for b in range(INDEX_BITS):
        if (index >> (INDEX_BITS - 1 - b)) & 1:
            strip[:, edges[b] : edges[b + 1]] = 255
    return strip


def read_frame_index(frame: np.ndarray, strip_rows: int | None = None) -> int:
    """Recover the index written by :func:`make_test_video` from a decoded RGB frame ``[H, W, 3]``.

    Reads the bottom strip (``strip_rows`` rows, default a quarter of the height) at the centre of each
    bit cell and thresholds at 128.
    """
    h, w = frame.shape[:2]
    rows = strip_rows or max(8, h // 4)
    gray = frame[h - rows :, :, :3].astype(np.float32).mean(axis=2)
    edges = np.linspace(0, w, INDEX_BITS + 1).astype(int)
    value = 0
    for b in range(INDEX_BITS):
        x0, x1 = edges[b], edges[b + 1]
        cell = gray[rows // 4 : rows - rows // 4, x0 + (x1 - x0) // 4 : x1 - (x1 - x0) // 4]
        value = (value << 1) | int(cell.mean() > 128)
    return value


def _scene_texture(scene: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + scene)
    # 16-pixel colour blocks on a black checkerboard whose phase flips with every scene: consecutive
    # scenes light disjoint pixels, so their HSV patch vectors are far apart (cosine near 0), while the
    # blocks compress well.
    gh, gw = -(-height // 16), -(-width // 16)
    small = rng.integers(64, 256, (gh, gw, 3)).astype(np.uint8)
    checker = (np.add.outer(np.arange(gh), np.arange(gw)) + scene) % 2 == 0
    small[~checker] = 0
    return np.kron(small, np.ones((16, 16, 1), np.uint8))[:height, :width]


def make_test_video(
    path: str | Path,
    n_frames: int,
    fps: float = 10.0,
    size: tuple[int, int] = (64, 128),
    *,
    vfr: bool = False,
    pattern: str = "index",
    scene_cuts: Sequence[int] = (),
    gop: int = 12,
    codec: str = "libx264",
    faststart: bool = False,
    bframes: int = 0,
) -> TestVideo:
    """Write an MP4 of ``n_frames`` frames (``size`` = (H, W), even) with the frame index in the pixels.

    ``pattern``:
      * ``"index"``: grey background, the index as bit cells over the bottom quarter;
      * ``"static"``: one fixed texture, the index in a thin bottom strip (about 1/16 of the area), so
        consecutive frames are near-identical (a slow-fast "static clip");
      * ``"scenes"``: like ``"static"`` but the texture changes at each index in ``scene_cuts``.
    ``vfr=True`` writes variable frame durations (alternating 0.5x and 1.5x the nominal 1/fps, plus a
    2x gap every 7th frame). ``faststart=True`` puts the MP4 index first (so a truncated copy still
    opens and lists every frame). Returns a :class:`TestVideo` with each frame's true timestamp.
    """
    import av

    h, w = size
    if h % 2 or w % 2 or n_frames < 1:
        raise KeyeConfigError(f"test video needs even size and >= 1 frame, got {size}, {n_frames}")
    if n_frames >= 1 << INDEX_BITS:
        raise KeyeConfigError(f"at most {(1 << INDEX_BITS) - 1} frames can be indexed")
    time_base = Fraction(1, 1000) if vfr else Fraction(1, 1) / Fraction(fps).limit_denominator(1000)
    pts, t = [], 0
    nominal = 1000 / fps
    for i in range(n_frames):
        if not vfr:
            pts.append(i)
            continue
        pts.append(int(round(t)))
        t += nominal * (2.0 if i % 7 == 6 else (0.5 if i % 2 == 0 else 1.5))
    container = av.open(str(path), mode="w", options={"movflags": "faststart"} if faststart else {})
    try:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.time_base = time_base
        stream.codec_context.time_base = time_base
        stream.codec_context.gop_size = gop
        if codec == "libx264":
            # Near-lossless keeps the bit cells exact; B-frames only when asked for.
            stream.options = {"crf": "10", "bf": str(bframes), "g": str(gop), "keyint_min": str(gop)}
        strip_rows = max(8, h // 4) if pattern == "index" else max(8, h // 16)
        cuts = sorted(set(scene_cuts))
        for i in range(n_frames):
            if pattern == "index":
                img = np.full((h, w, 3), 96, np.uint8)
            elif pattern in ("static", "scenes"):
                scene = sum(1 for c in cuts if c <= i) if pattern == "scenes" else 0
                img = _scene_texture(scene, h, w).copy()
            else:
                raise KeyeConfigError(f"unknown test video pattern {pattern!r}")
            img[h - strip_rows :] = _bit_cells(i, h, w, strip_rows)[..., None]
            frame = av.VideoFrame.from_ndarray(img, format="rgb24")
            frame.pts = pts[i]
            frame.time_base = time_base
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    finally:
        container.close()
    return TestVideo(Path(path), [float(p * time_base) for p in pts], h, w)


def read_index_strip_rows(height: int, pattern: str = "index") -> int:
    """Rows of the index strip :func:`make_test_video` used for a frame of ``height`` pixels."""
    return max(8, height // 4) if pattern == "index" else max(8, height // 16)
