"""What the SFT step feeds the model and how DeepSpeed is configured for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from keye.errors import KeyeConfigError
from keye.sft.config import SFTConfig

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


def cycle_batches(loader):
    while True:
        yield from loader


def deepspeed_config(cfg: SFTConfig, world_size: int, device_type: str,
                     model_dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO run: ``train.deepspeed_config`` (default
    ``training/deepspeed/<strategy>.json``) with batch sizes, accumulation (``data.micro_batches``) and
    clipping (``train.grad_clip``) from the recipe.

    ``"enabled": "auto"`` in the ``bf16`` / ``fp16`` sections (the HF-Trainer convention the shipped configs
    use) is resolved from ``model_dtype``: DeepSpeed itself reads the string as *disabled*, which for a bf16
    model means no bf16 engine and no float32 master weights. On CPU the ``bf16`` section is dropped.

    Raises:
        KeyeConfigError: the file is missing or not JSON (the message names it).
    """
    ds_path = cfg.train.deepspeed_config or f"training/deepspeed/{cfg.train.strategy}.json"
    try:
        ds_cfg = json.loads(Path(ds_path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise KeyeConfigError(f"{ds_path}: cannot read the DeepSpeed config ({err})") from None
    ds_cfg["train_micro_batch_size_per_gpu"] = 1
    ds_cfg["gradient_accumulation_steps"] = cfg.data.micro_batches
    ds_cfg["train_batch_size"] = cfg.data.micro_batches * world_size
    ds_cfg["gradient_clipping"] = cfg.train.grad_clip
    for section, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if isinstance(ds_cfg.get(section), dict) and ds_cfg[section].get("enabled") == "auto":
            ds_cfg[section]["enabled"] = model_dtype == dtype
    if device_type != "cuda":
        ds_cfg.pop("bf16", None)
    return ds_cfg
