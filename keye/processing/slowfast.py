"""Keye-VL-1.5 slow-fast frame selection and token budgets (architecture.md §10.3-10.5).

* :func:`classify_frames`: frame 0 is slow; each later frame is compared with the last slow (key) frame
  by HSV patch similarity and becomes slow when fewer than ``min_frame_similarity`` (0.9) of its 28x28
  patches have cosine > 0.7.
* :func:`slowfast_sizes`: binary search of the per-slow-frame token count under the total budget, fast
  frames at 30 % of a slow frame, and the resulting slow / fast resolutions. Pure arithmetic, usable by
  cost models without pixels.
* :func:`rgb_to_hsv_u8`: OpenCV's 8-bit ``RGB2HSV`` (H in [0, 180), S and V in [0, 255]) bit for bit, in
  numpy; classification calls OpenCV itself when ``opencv-python-headless`` is installed (tested equal on
  all 2^24 colours).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from keye.errors import KeyeInputError
from keye.processing.image import IMAGE_FACTOR, smart_resize

logger = logging.getLogger(__name__)

SLOW, FAST = 0, 1
TOKEN_PIXELS = 28 * 28
VIDEO_MIN_PIXELS = 48 * TOKEN_PIXELS  # 37,632
VIDEO_MAX_PIXELS = 768 * TOKEN_PIXELS  # 602,112
VIDEO_TOTAL_PIXELS = 65536 * TOKEN_PIXELS  # 51,380,224
SIM_MAX_PIXELS = 256 * TOKEN_PIXELS  # resolution at which similarity is measured
FAST_TOKEN_RATIO = 0.3
MIN_FRAME_SIMILARITY = 0.9
PATCH_COS_THRESHOLD = 0.7
SIM_PATCH = 28

_HSV_SHIFT = 12
_I = np.arange(256, dtype=np.float64)
with np.errstate(divide="ignore"):
    # OpenCV's tables: saturate_cast<int> rounds to nearest; entry 0 is 0.
    _SDIV = np.where(_I > 0, np.rint((255 << _HSV_SHIFT) / _I), 0).astype(np.int32)
    _HDIV180 = np.where(_I > 0, np.rint((180 << _HSV_SHIFT) / (6.0 * _I)), 0).astype(np.int32)


def rgb_to_hsv_u8(rgb: np.ndarray) -> np.ndarray:
    """OpenCV ``cvtColor(rgb, COLOR_RGB2HSV)`` for uint8 ``[..., 3]`` RGB; returns uint8 HSV, same shape.

    Integer maths with OpenCV's 12-bit fixed-point division tables, so results match OpenCV exactly.
    """
    if rgb.dtype != np.uint8 or rgb.shape[-1] != 3:
        raise KeyeInputError(f"rgb_to_hsv_u8 expects uint8 [..., 3], got {rgb.dtype} {rgb.shape}")
    # int32 is enough: the largest product is 255 * (255 << 12) < 2**31.
    x = rgb.astype(np.int32)
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    v = np.maximum(np.maximum(r, g), b)
    vmin = np.minimum(np.minimum(r, g), b)
    diff = v - vmin
    half = 1 << (_HSV_SHIFT - 1)
    s = (diff * _SDIV[v] + half) >> _HSV_SHIFT
    h = np.where(v == r, g - b, np.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * _HDIV180[diff] + half) >> _HSV_SHIFT
    h = np.where(h < 0, h + 180, h)
    return np.stack([h, s, v], axis=-1).astype(np.uint8)


def _patch_vectors(hsv: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 HSV [H, W, 3] -> (unit patch vectors [gh, gw, 3*28*28] in (c, y, x) order, L2 norms + 1e-8).

    torch float32 with the reference's op order (norm, divide, multiply, sum), so cosines sitting on the
    0.7 threshold round the same way as in keye-vl-utils.
    """
    h, w, _ = hsv.shape
    gh, gw = h // SIM_PATCH, w // SIM_PATCH
    x = torch.from_numpy(np.ascontiguousarray(hsv[: gh * SIM_PATCH, : gw * SIM_PATCH])).float()
    x = x.permute(2, 0, 1).reshape(3, gh, SIM_PATCH, gw, SIM_PATCH).permute(1, 3, 0, 2, 4)
    x = x.reshape(gh, gw, -1).contiguous()
    norm = torch.norm(x, p=2, dim=-1, keepdim=True) + 1e-8
    return x / norm, norm


def frame_similarity(
    key_hsv: np.ndarray, frame_hsv: np.ndarray, patch_threshold: float = PATCH_COS_THRESHOLD
) -> float:
    """Fraction of 28x28 HSV patches whose cosine similarity exceeds ``patch_threshold`` (§10.3).

    Patches black in both frames (both norms < 0.01) are left out; with no patch left the frames count
    as identical (1.0). The fraction is a float32 mean, as in the reference: 9 of 10 patches gives
    0.89999998, which is below a 0.9 threshold.
    """
    return _similarity(_patch_vectors(key_hsv), _patch_vectors(frame_hsv), patch_threshold)


def _similarity(
    key: tuple[torch.Tensor, torch.Tensor], cur: tuple[torch.Tensor, torch.Tensor], patch_threshold: float
) -> float:
    (a, na), (b, nb) = key, cur
    cos = (a * b).sum(dim=-1)
    valid = ~((na[..., 0] < 0.01) & (nb[..., 0] < 0.01))
    if not bool(valid.any()):
        return 1.0
    # float32 mean on purpose: the float64 fraction would flip frames sitting exactly on the threshold.
    return float((cos[valid] > patch_threshold).float().mean())


def _hsv_fast(rgb: np.ndarray) -> np.ndarray:
    """OpenCV's own conversion when opencv-python-headless is installed (same bits, ~50x faster)."""
    try:
        import cv2
    except ImportError:
        return rgb_to_hsv_u8(rgb)
    return cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2HSV)


def resize_frames(frames: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Bilinear antialiased resize of uint8 ``[n, 3, H, W]`` frames (torch's uint8 kernel, as the 1.5
    processor's ``F.interpolate``); returns uint8 ``[n, 3, h, w]``."""
    if frames.shape[0] == 0:
        return frames.new_zeros((0, frames.shape[1], *size_hw))
    if tuple(frames.shape[2:]) == tuple(size_hw):
        return frames.clone()
    return F.interpolate(frames, size=tuple(size_hw), mode="bilinear", antialias=True, align_corners=False)


def classify_frames(
    frames: torch.Tensor | np.ndarray,
    min_frame_similarity: float = MIN_FRAME_SIMILARITY,
    patch_threshold: float = PATCH_COS_THRESHOLD,
) -> np.ndarray:
    """Slow (0) / fast (1) type of each frame of a uint8 ``[n, 3, H, W]`` clip (§10.3).

    Frames are first resized to ``smart_resize(H, W, 28, 37632, 200704)`` (bilinear, antialias). Frame 0
    is slow; frame i is slow when its similarity to the last slow frame is below ``min_frame_similarity``.
    Returns int32 ``[n]``.
    """
    if isinstance(frames, np.ndarray):
        frames = torch.from_numpy(frames)
    n, _, h, w = frames.shape
    types = np.zeros(n, np.int32)
    if n == 0:
        return types
    size = smart_resize(h, w, IMAGE_FACTOR, VIDEO_MIN_PIXELS, SIM_MAX_PIXELS, clamp_min_side=True)
    small = resize_frames(frames, size).permute(0, 2, 3, 1).contiguous().numpy()
    key = _patch_vectors(_hsv_fast(small[0]))
    for i in range(1, n):
        cur = _patch_vectors(_hsv_fast(small[i]))
        if _similarity(key, cur, patch_threshold) < min_frame_similarity:
            key = cur
        else:
            types[i] = FAST
    return types


@dataclass(frozen=True)
class SlowFastSizes:
    """Budgeted resolutions of one 1.5 video.

    ``slow_hw`` / ``fast_hw`` in pixels (multiples of 28); ``slow_tokens`` / ``fast_tokens`` LLM tokens per
    frame (h*w/784); ``budget_tokens`` the per-slow-frame token count the search settled on;
    ``total_tokens`` = n_slow*slow_tokens + n_fast*fast_tokens.
    """

    n_slow: int
    n_fast: int
    slow_hw: tuple[int, int]
    fast_hw: tuple[int, int]
    slow_tokens: int
    fast_tokens: int
    budget_tokens: int

    @property
    def total_tokens(self) -> int:
        """Vision tokens of the whole video (excluding marker/timestamp text tokens)."""
        return self.n_slow * self.slow_tokens + self.n_fast * self.fast_tokens

    def with_slow_size(self, height: int, width: int) -> SlowFastSizes:
        """Override the slow size (``resized_height``/``resized_width``); fast frames keep their size."""
        hw = smart_resize(int(height), int(width), IMAGE_FACTOR, clamp_min_side=True)
        return replace(self, slow_hw=hw, slow_tokens=hw[0] * hw[1] // TOKEN_PIXELS)


def slowfast_sizes(
    n_slow: int,
    n_fast: int,
    height: int,
    width: int,
    *,
    min_pixels: float | None = None,
    max_pixels: float | None = None,
    total_pixels: float | None = None,
    fast_ratio: float = FAST_TOKEN_RATIO,
    floor_pixels: float | None = None,
    item: Any = None,
) -> SlowFastSizes:
    """Slow/fast resolutions for a ``height x width`` video with ``n_slow`` + ``n_fast`` frames (§10.4).

    keye-vl-utils 1.5.2's rule, to the last bit: binary search over the per-slow-frame token count T on
    ``[min_pixels/784, max_pixels/784)`` (plain divisions, so the bounds may be fractional) with the
    estimate ``784*(n_slow*T + n_fast*max(int(0.3*T), min_tokens))``; the search settles on the first T
    whose estimate exceeds ``total_pixels`` (or the upper bound), so a video may pass the budget by up to
    one token per slow frame, as in the reference. Slow size: ``smart_resize(H, W, 28, min_pixels,
    T*784)``; fast size: ``smart_resize(H, W, 28, min_pixels, max(int(0.3*slow_tokens)*784, floor))``,
    whose cap follows the fixed floor, not the item's ``min_pixels``.

    Defaults: min 37,632, max 602,112, total 51,380,224 pixels. ``floor_pixels`` (keye's checkpoint
    option, e.g. a tiny CPU model) replaces the fixed 37,632-pixel floor. When even the smallest frames
    exceed ``total_pixels`` the reference still returns them at the floor size; so does this function,
    with a logged warning. Raises :class:`KeyeInputError` when there is no slow frame.
    """
    floor = int(floor_pixels or VIDEO_MIN_PIXELS)
    lo_px = max(int(min_pixels if min_pixels is not None else floor), floor)
    hi_px = max_pixels if max_pixels is not None else VIDEO_MAX_PIXELS
    total = total_pixels if total_pixels is not None else VIDEO_TOTAL_PIXELS
    if n_slow < 1 or n_fast < 0:
        raise KeyeInputError(
            f"a video needs at least one slow frame (got {n_slow} slow, {n_fast} fast)", item=item
        )
    min_tokens = int(lo_px / TOKEN_PIXELS)

    def est(t: float) -> float:
        return TOKEN_PIXELS * (n_slow * t + n_fast * max(int(fast_ratio * t), min_tokens))

    if est(min_tokens) > total:
        logger.warning(
            "%s: %d frames need at least %s pixels at min_pixels=%s, over the total budget of %s; "
            "using the smallest frame size anyway (as keye-vl-utils does)",
            item if item is not None else "video",
            n_slow + n_fast,
            f"{est(min_tokens):,.0f}",
            f"{lo_px:,}",
            f"{total:,}",
        )
    # Float bounds on purpose: the reference divides without rounding, and a fractional bound changes
    # where the search stops.
    left: float = lo_px / TOKEN_PIXELS
    right: float = hi_px / TOKEN_PIXELS
    while left < right:
        mid = int(left + right) // 2
        if est(mid) > total:
            right = mid
        else:
            left = mid + 1
    slow_hw = smart_resize(
        height, width, IMAGE_FACTOR, lo_px, left * TOKEN_PIXELS, clamp_min_side=True, item=item
    )
    slow_tokens = slow_hw[0] * slow_hw[1] // TOKEN_PIXELS
    fast_max = max(int(slow_tokens * fast_ratio) * TOKEN_PIXELS, floor)
    fast_hw = smart_resize(height, width, IMAGE_FACTOR, lo_px, fast_max, clamp_min_side=True, item=item)
    return SlowFastSizes(
        n_slow, n_fast, slow_hw, fast_hw, slow_tokens, fast_hw[0] * fast_hw[1] // TOKEN_PIXELS, int(left)
    )


def max_frames_for_budget(
    min_pixels: float | None = None, total_pixels: float | None = None, floor_pixels: float | None = None
) -> int:
    """Frame cap of the 1.5 sampler: ``int(total_pixels / min_pixels)`` (1365 by default).

    As in keye-vl-utils 1.5.2 the item's ``min_pixels`` is used as given (not raised to the 37,632-pixel
    floor that the frame sizes use); without it the floor (``floor_pixels`` or 37,632) divides.
    """
    lo = min_pixels if min_pixels is not None else (floor_pixels or VIDEO_MIN_PIXELS)
    return int((total_pixels if total_pixels is not None else VIDEO_TOTAL_PIXELS) / lo)
