"""Which parameters train and how: towers, stage presets (freezing), AdamW parameter groups with per-tower
learning rates, the LR schedule. Both recipes build their optimizer here from a
:class:`keye.train.sections.OptimSection`."""

from __future__ import annotations

import math
from typing import Any

import torch

from keye.errors import KeyeConfigError
from keye.train.sections import OptimSection

TOWERS = {"vision": ("visual.",), "projector": ("mlp_AR.",), "llm": ("model.", "lm_head.")}
STAGE_FREEZE = {"align": ["vision", "llm"], "full": [], "llm_only": ["vision"]}


def tower_of(name: str) -> str:
    """Which tower a parameter belongs to (``vision``, ``projector`` or ``llm``); PEFT prefixes ignored."""
    for prefix in ("base_model.model.",):
        name = name.removeprefix(prefix)
    for tower, prefixes in TOWERS.items():
        if name.startswith(prefixes):
            return tower
    raise KeyeConfigError(f"parameter {name!r} belongs to no known tower")


def apply_freezing(model: torch.nn.Module, cfg: OptimSection) -> list[str]:
    """Set ``requires_grad`` per the stage preset; returns the frozen tower names."""
    frozen = list(cfg.freeze) if cfg.stage == "custom" else STAGE_FREEZE[cfg.stage]
    bad = sorted(set(frozen) - set(TOWERS))
    if bad:
        raise KeyeConfigError(f"train.freeze has unknown tower(s) {bad}; use vision, projector, llm")
    for name, p in model.named_parameters():
        p.requires_grad_(tower_of(name) not in frozen)
    return frozen


def param_groups(model: torch.nn.Module, cfg: OptimSection) -> list[dict[str, Any]]:
    """AdamW parameter groups: one per tower (own lr), no weight decay on norms and biases."""
    lrs = {"vision": cfg.lr_vision, "projector": cfg.lr_projector, "llm": cfg.lr_llm}
    groups: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim < 2 or "norm" in name
        groups.setdefault((tower_of(name), no_decay), []).append(p)
    out = []
    for (tower, no_decay), params in sorted(groups.items()):
        lr = lrs[tower] if lrs[tower] is not None else cfg.lr
        out.append({"params": params, "lr": lr, "initial_lr": lr, "weight_decay": 0.0 if no_decay else cfg.weight_decay,
                    "name": f"{tower}{'_no_decay' if no_decay else ''}"})
    if not out:
        raise KeyeConfigError("no trainable parameters: check train.stage / train.freeze / lora")
    return out


def lr_lambda(cfg: OptimSection, total_steps: int):
    """Warmup then cosine / linear decay to ``min_lr_ratio`` (or constant)."""

    def fn(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant" or total_steps <= cfg.warmup_steps:
            return 1.0
        frac = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.schedule == "linear":
            decay = 1.0 - frac
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * frac))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return fn


def build_optimizer(model: torch.nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters (:func:`param_groups`: one group per tower and decay kind)
    with ``cfg``'s learning rate, betas, epsilon and weight decay. Build it after a sharding wrapper that replaces the
    parameters (FSDP2's DTensors), before one that takes the optimizer (DeepSpeed)."""
    return torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimSection,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of ``cfg`` (:func:`lr_lambda`) over ``total_steps`` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))


__all__ = ["STAGE_FREEZE", "TOWERS", "apply_freezing", "build_optimizer", "build_scheduler", "lr_lambda",
           "param_groups", "tower_of"]
