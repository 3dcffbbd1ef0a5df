"""The model side of an SFT run: the checkpoint loaded for training (stage freezing, LoRA, float32 master weights
for bf16), wrapped for the parallel strategy with its optimizer and LR schedule."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keye.sft.config import SFTConfig
from keye.sft.step import deepspeed_config
from keye.train import dist as kdist
from keye.train.lora import apply_lora
from keye.train.models import resolve_dtype
from keye.train.optim import apply_freezing, build_optimizer, build_scheduler


@dataclass
class TrainModel:
    """The model of an SFT run as :func:`load_train_model` prepares it.

    ``frozen``: the frozen towers. ``amp``: bf16 autocast over float32 trainable weights (bf16 checkpoints outside
    ZeRO). ``export_dtype``: the dtype the official export holds when it differs from the trainable weights'
    (``amp``), else None.
    """

    model: torch.nn.Module
    frozen: list[str]
    amp: bool
    export_dtype: torch.dtype | None


def load_train_model(cfg: SFTConfig, info: kdist.DistInfo, model_path: str | Path) -> TrainModel:
    """The checkpoint at ``model_path`` in training mode: ``model.dtype`` (auto: bf16 on a GPU), gradient
    checkpointing, ``train.stage`` / ``train.freeze``, LoRA adapters; with bf16 outside ZeRO the trainable weights
    are kept in float32 (autocast computes in bf16)."""
    from keye.model.keye_vl import KeyeVL

    dtype = resolve_dtype(cfg.model.dtype, info.device)
    model = KeyeVL.from_pretrained(model_path, torch_dtype=dtype, attn_implementation=cfg.model.attn_implementation)
    model.train()
    # Data-parallel/sharded ranks must run identical modules even when a micro-batch has no pixels.
    model.always_run_vision = info.distributed
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    frozen = apply_freezing(model, cfg.train)
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    # bf16 training: compute in bf16 (autocast) but keep the trainable weights in float32. AdamW's step is
    # ~lr per element, far below bf16's resolution of a weight at SFT learning rates (1e-5 vs ~1e-4 for a
    # weight of 0.02), so pure bf16 weights would silently drop most updates. Frozen weights stay in bf16;
    # DeepSpeed keeps its own float32 master weights (its bf16 setting).
    export_dtype = next(model.parameters()).dtype
    amp = export_dtype == torch.bfloat16 and cfg.train.strategy not in ("zero2", "zero3")
    if amp:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return TrainModel(model, frozen, amp, export_dtype if amp else None)


def wrap_for_training(cfg: SFTConfig, model: torch.nn.Module, info: kdist.DistInfo,
                      total_steps: int) -> tuple[kdist.Wrapped, torch.optim.Optimizer, Any]:
    """Wrap ``model`` for ``train.strategy`` (DDP, FSDP2, DeepSpeed ZeRO-2/3) on this rank's device with its AdamW
    (:func:`keye.train.optim.build_optimizer`) and LR schedule over ``total_steps``; returns (wrapped, optimizer,
    scheduler). The schedule drives the torch optimizer's param groups, which DeepSpeed's ZeRO optimizer shares."""
    if cfg.train.strategy == "fsdp2":
        wrapped = kdist.wrap_model(model, cfg.train.strategy, info)
        optimizer = build_optimizer(model, cfg.train)  # after wrapping: FSDP2's parameters are DTensors
    else:
        ds_cfg = None
        if cfg.train.strategy in ("zero2", "zero3"):
            ds_cfg = deepspeed_config(cfg, info.world_size, info.device.type, next(model.parameters()).dtype)
        model.to(info.device)
        optimizer = build_optimizer(model, cfg.train)
        wrapped = kdist.wrap_model(model, cfg.train.strategy, info, optimizer=optimizer, deepspeed_config=ds_cfg)
        if cfg.train.strategy == "zero3" and cfg.train.loss_chunk_tokens is not None:
            import deepspeed

            # the chunked loss reads lm_head.weight inside KeyeVL.forward, not through lm_head's own forward, so
            # ZeRO-3 must gather it with the root module's
            deepspeed.zero.register_external_parameter(model, model.lm_head.weight)
    return wrapped, optimizer, build_scheduler(optimizer, cfg.train, total_steps)


__all__ = ["TrainModel", "load_train_model", "wrap_for_training"]
