"""What an SFT micro-batch feeds the model: the loader keys the forward takes, and the constants the label and
vision bookkeeping share."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

MODEL_INPUT_KEYS = (
    "input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw", "pixel_values_videos",
    "video_grid_thw", "second_per_grid_ts", "seq_lens", "position_ids",
)


VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


IGNORE_INDEX = -100


def model_inputs(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The tensors of a loader micro-batch that the model's forward takes, moved to ``device``."""
    out = {}
    for k in MODEL_INPUT_KEYS:
        v = batch.get(k)
        if v is None:
            continue
        if k == "seq_lens" and not batch.get("packed", "cu_seqlens" in batch):
            continue
        out[k] = v.to(device, non_blocking=True) if torch.is_tensor(v) else v
    if "seq_lens" in out and out["input_ids"].shape[0] != 1:
        del out["seq_lens"]
    return out


def cycle_batches(loader: Iterable[Any]) -> Iterator[Any]:
    """The loader's micro-batches epoch after epoch, without end (the loader advances its own epoch)."""
    while True:
        yield from loader
