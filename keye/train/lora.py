"""LoRA on the Keye towers (peft): injecting adapters, folding them into the official-layout export, and the
checks a LoRA resume needs (the base model must be the one the adapters were trained on)."""

from __future__ import annotations

from pathlib import Path

import torch

from keye.errors import KeyeConfigError
from keye.train import dist as kdist
from keye.train.optim import tower_of
from keye.train.sections import LoraSection

LORA_TARGETS = {
    "llm": r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)",
    "vision": r"visual\.vision_model\.encoder\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])",
}


def apply_lora(model: torch.nn.Module, cfg: LoraSection) -> torch.nn.Module:
    """Inject LoRA adapters (peft) into the chosen towers; base weights of those towers are frozen,
    other trainable parts (e.g. the projector) stay trainable."""
    from peft import LoraConfig, inject_adapter_in_model

    bad = sorted(set(cfg.targets) - set(LORA_TARGETS))
    if bad:
        raise KeyeConfigError(f"lora.targets has unknown entries {bad}; use llm and/or vision")
    pattern = "|".join(f"(?:{LORA_TARGETS[t]})" for t in cfg.targets)
    lcfg = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=f"^(?:{pattern})$")
    trainable_before = {n for n, p in model.named_parameters() if p.requires_grad}
    model = inject_adapter_in_model(lcfg, model)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.requires_grad_(True)
        elif tower_of(name) in cfg.targets:
            p.requires_grad_(False)
        else:
            p.requires_grad_(name in trainable_before)
    return model


def lora_scaling(model: torch.nn.Module) -> dict[str, float]:
    """alpha / r of every LoRA-wrapped module, by module name."""
    return {n: float(m.scaling.get("default", 1.0)) for n, m in model.named_modules()
            if isinstance(getattr(m, "scaling", None), dict)}


def merged_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The official-layout state dict: LoRA deltas folded into their base weights, adapter tensors dropped."""
    state = state if state is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    scaling = lora_scaling(model)
    for key, val in state.items():
        if "lora_" in key:
            continue
        if key.endswith(".base_layer.weight") or key.endswith(".base_layer.bias"):
            mod = key.rsplit(".base_layer.", 1)[0]
            kind = key.rsplit(".", 1)[1]
            new_key = f"{mod}.{kind}"
            if kind == "weight" and f"{mod}.lora_A.default.weight" in state:
                a = state[f"{mod}.lora_A.default.weight"].float()
                b = state[f"{mod}.lora_B.default.weight"].float()
                val = (val.float() + scaling.get(mod, 1.0) * (b @ a)).to(val.dtype)
            out[new_key] = val
        else:
            out[key] = val
    return out


def lora_base_weights(wrapped: kdist.Wrapped) -> dict[str, torch.Tensor]:
    """The current base weights (and biases) of the LoRA-wrapped modules, full and on CPU on every rank."""
    model = wrapped.model
    out = {}
    for name, p in model.named_parameters():
        if ".base_layer." not in name:
            continue
        if wrapped.strategy == "zero3" and hasattr(p, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
                out[name] = p.detach().cpu().clone()
        elif hasattr(p, "full_tensor"):  # FSDP2 shard
            out[name] = p.detach().full_tensor().cpu()
        else:
            out[name] = p.detach().cpu().clone()
    return out


def check_lora_base(ckpt_dir: Path, remerged: dict[str, torch.Tensor], official: dict[str, torch.Tensor],
                     base: dict[str, torch.Tensor]) -> None:
    """Raise unless folding the checkpoint's adapters into ``base`` reproduces the checkpoint's export (up to
    the model dtype's rounding, which another machine's matmul may flip): the base model is the one it was
    trained from."""
    for key in base:
        merged_key = key.replace(".base_layer.", ".")
        got, want = remerged[merged_key].float(), official[merged_key].float()
        eps = torch.finfo(official[merged_key].dtype).eps
        if not torch.allclose(got, want, rtol=2 * eps, atol=1e-3 * eps):
            raise KeyeConfigError(
                f"{ckpt_dir}: the LoRA checkpoint was not trained from this model.path ({merged_key} differs "
                f"by up to {float((got - want).abs().max()):.3g}); resume with the base model it was trained "
                f"from")
