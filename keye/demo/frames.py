"""What the model saw: the processed frames and images of a batch, rebuilt from its pixel rows.

The processor hands the vision tower normalised 14x14 patches in raster order (frame, patch row, patch
column). Undoing the patchify and the normalisation gives back each frame at the exact resolution the
model used, so slow frames look sharp and fast frames look coarse, as they are to the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image


@dataclass
class SeenFrame:
    """One picture the model saw.

    ``image`` RGB at the processed resolution; ``source`` the item ("video 0", "image 1"); ``index`` the
    frame index in the source video (None for images); ``timestamp`` seconds (None when unknown);
    ``kind`` "slow", "fast" or "image"; ``tokens`` LLM tokens it costs; ``size`` processed ``(h, w)`` pixels.
    """

    image: Image.Image
    source: str
    index: int | None
    timestamp: float | None
    kind: str
    tokens: int
    size: tuple[int, int]

    def caption(self) -> str:
        """Short gallery caption, e.g. ``"2.5 s · slow · 120 tok"``."""
        parts = []
        if self.timestamp is not None:
            parts.append(f"{self.timestamp:.1f} s")
        elif self.index is not None:
            parts.append(f"frame {self.index}")
        else:
            parts.append(self.source)
        parts += [self.kind, f"{self.tokens} tok"]
        return " · ".join(parts)


def unpatchify(rows: torch.Tensor, grid_hw: tuple[int, int], mean: Any, std: Any) -> np.ndarray:
    """Patch rows ``[h*w, 3, p, p]`` (normalised float) of one frame -> uint8 RGB ``[h*p, w*p, 3]``.

    ``mean``/``std`` are the processor's per-channel normalisation (values in [0, 1] units).
    """
    h, w = grid_hw
    n, c, p, _ = rows.shape
    if n != h * w:
        raise ValueError(f"{n} patch rows do not tile a {h}x{w} grid")
    x = (
        rows.detach()
        .float()
        .cpu()
        .numpy()
        .reshape(h, w, c, p, p)
        .transpose(0, 3, 1, 4, 2)
        .reshape(h * p, w * p, c)
    )
    x = x * np.asarray(std, dtype=np.float32) + np.asarray(mean, dtype=np.float32)
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


def seen_frames(batch: Any, processor: Any) -> list[SeenFrame]:
    """Every frame / image in a processed single-conversation ``batch``, in prompt order per kind
    (videos first, then images), with its timestamp, slow/fast type and token count."""
    cfg = processor.image_processor.config
    merge2 = cfg.merge_size**2
    out: list[SeenFrame] = []
    pv = batch.get("pixel_values_videos")
    start = 0
    for meta in batch.video_meta:
        times = meta.timestamps or [None] * len(meta.indices)
        for j, (grid, kind) in enumerate(zip(meta.frame_grids, meta.frame_types)):
            n = grid[1] * grid[2]
            arr = unpatchify(pv[start : start + n], (grid[1], grid[2]), cfg.image_mean, cfg.image_std)
            start += n
            idx = meta.indices[j] if j < len(meta.indices) else None
            ts = times[j] if j < len(times) else None
            out.append(
                SeenFrame(
                    Image.fromarray(arr), f"video {meta.index}", idx, ts, kind, n // merge2, arr.shape[:2]
                )
            )
    pv = batch.get("pixel_values")
    start = 0
    for meta in batch.image_meta:
        t, h, w = meta.grid_thw
        n = t * h * w
        arr = unpatchify(pv[start : start + n], (h, w), cfg.image_mean, cfg.image_std)
        start += n
        out.append(
            SeenFrame(
                Image.fromarray(arr), f"image {meta.index}", None, None, "image", meta.tokens, arr.shape[:2]
            )
        )
    return out


def token_summary(batch: Any, frames: list[SeenFrame]) -> dict[str, Any]:
    """Counts for the page: prompt tokens, visual tokens, slow / fast frames and images, and the
    processed slow / fast frame sizes."""
    slow = [f for f in frames if f.kind == "slow"]
    fast = [f for f in frames if f.kind == "fast"]
    images = [f for f in frames if f.kind == "image"]
    return {
        "prompt_tokens": int(batch["attention_mask"][0].sum()),
        "visual_tokens": sum(f.tokens for f in frames),
        "slow_frames": len(slow),
        "fast_frames": len(fast),
        "images": len(images),
        "slow_size": slow[0].size if slow else None,
        "fast_size": fast[0].size if fast else None,
        "slow_tokens": sum(f.tokens for f in slow),
        "fast_tokens": sum(f.tokens for f in fast),
        "image_tokens": sum(f.tokens for f in images),
    }
