"""Tiny Keye-VL models for tests, benchmarks and examples (random weights, built offline)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from keye.config import KeyeVLConfig, tiny_config


@torch.no_grad()
def init_unit_scale(model: nn.Module, seed: int = 0) -> nn.Module:
    """Re-initialise ``model`` so activations stay around 1 (the golden fixtures' scheme).

    Matrices N(0, 1/sqrt(fan_in)); embedding tables N(0, 0.5); biases N(0, 0.1); norm weights
    1 + 0.1*N(0, 1); LayerNorm biases 0.1*N(0, 1). With such weights a numerical slip anywhere moves
    the logits visibly, which is what parity tests need (the usual 0.02-std init hides them).
    """
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.weight.copy_(normal(module.weight.shape, 0.5))
        elif isinstance(module, (nn.Linear, nn.Conv2d)):
            fan_in = module.weight[0].numel()
            module.weight.copy_(normal(module.weight.shape, 1 / math.sqrt(fan_in)))
            if module.bias is not None:
                module.bias.copy_(normal(module.bias.shape, 0.1))
        elif isinstance(module, nn.LayerNorm):
            module.weight.copy_(normal(module.weight.shape, 0.1, 1.0))
            module.bias.copy_(normal(module.bias.shape, 0.1))
        elif type(module).__name__ == "RMSNorm":
            module.weight.copy_(normal(module.weight.shape, 0.1, 1.0))
    return model


def make_tiny_model(variant: str = "preview", seed: int = 0, **config_overrides: Any):
    """A random tiny :class:`~keye.KeyeVL` (float32, eval mode) of :func:`keye.config.tiny_config`."""
    from keye.model.keye_vl import KeyeVL

    torch.manual_seed(seed)
    config: KeyeVLConfig = tiny_config(variant, **config_overrides)
    return init_unit_scale(KeyeVL(config), seed).eval()


def save_tiny_checkpoint(directory: str | Path, variant: str = "preview", seed: int = 0, **config_overrides: Any) -> Path:
    """Write a random tiny checkpoint (config.json + model.safetensors) and return its directory."""
    model = make_tiny_model(variant, seed, **config_overrides)
    return model.save_pretrained(directory)


def qwen3_twin(model, *, bos_token_id: int | None = None, eos_token_id: int | list[int] | None = None,
               pad_token_id: int | None = None, attn_implementation: str = "sdpa"):
    """transformers' ``Qwen3ForCausalLM`` holding ``model``'s decoder and head weights (same dtype), the
    reference that keye's text path is compared with in tests and benchmarks.

    The token ids default to ``model.generation_config``'s. Raises AssertionError when the state dicts do
    not line up (any tensor besides Qwen3's rotary buffers missing or unexpected).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t = model.config.text
    gen = model.generation_config
    cfg = Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta}, tie_word_embeddings=False,
        attention_bias=False, attn_implementation=attn_implementation,
        bos_token_id=gen.bos_token_id if bos_token_id is None else bos_token_id,
        eos_token_id=gen.eos_token_id if eos_token_id is None else eos_token_id,
        pad_token_id=gen.pad_token_id if pad_token_id is None else pad_token_id,
    )
    hf = Qwen3ForCausalLM(cfg).to(model.dtype).eval()
    ours = {k: v for k, v in model.state_dict().items() if k.startswith(("model.", "lm_head."))}
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return hf
