"""Qwen3 decoder with 3-D mRoPE (``model.*`` and ``lm_head`` in the checkpoints).

Per layer (pre-norm): h = x + o_proj(attn(RMSNorm(x))); y = h + down(silu(gate(.)) * up(.)).
q and k get a per-head RMSNorm (``q_norm`` / ``k_norm``) **before** RoPE. RMSNorm normalises in float32,
casts back to the input dtype and only then multiplies by the weight, as the reference does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from keye.config import TextConfig
from keye.model.attention import padded_attention, varlen_attention
from keye.model.rope import apply_text_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class KVCache:
    """Per-layer key/value cache with preallocated, geometrically grown buffers.

    ``keys[i]`` / ``values[i]`` are [B, Hkv, capacity, d]; ``length`` positions are valid.
    """

    def __init__(self, num_layers: int, capacity: int = 0):
        self.num_layers = num_layers
        self.capacity = capacity
        self.length = 0
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v [B, Hkv, n, d] for ``layer``; return all valid keys/values so far."""
        start = self.length
        end = start + k.shape[2]
        buf_k = self.keys[layer]
        if buf_k is None or buf_k.shape[2] < end:
            cap = max(end, self.capacity, 2 * (0 if buf_k is None else buf_k.shape[2]))
            new_k = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            new_v = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            if buf_k is not None:
                new_k[:, :, :start] = buf_k[:, :, :start]
                new_v[:, :, :start] = self.values[layer][:, :, :start]
            self.keys[layer], self.values[layer] = new_k, new_v
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions valid (called once per forward, after every layer updated)."""
        self.length += n

    def reorder(self, index: torch.Tensor) -> None:
        """Keep only batch rows ``index`` (e.g. after dropping finished sequences)."""
        for i in range(self.num_layers):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i].index_select(0, index)
                self.values[i] = self.values[i].index_select(0, index)


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.backend = "sdpa"

    def forward(self, x, cos, sin, key_mask=None, cache: KVCache | None = None, cu_seqlens=None, attn_override=None):
        bsz, seq, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = apply_text_rope(q, cos, sin)
        k = apply_text_rope(k, cos, sin)
        if attn_override is not None:
            # Custom attention pattern (e.g. shared-prefix tree batches): q [B, Hq, L, d], k/v [B, Hkv, L, d].
            o = attn_override(q, k, v, layer_idx=self.layer_idx, scale=self.scale)
        elif cu_seqlens is not None:
            # Packed samples in one row: causal attention inside each sample only.
            o = varlen_attention(
                q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_seqlens,
                scale=self.scale, causal=True, backend=self.backend,
            ).transpose(0, 1)[None]
        else:
            if isinstance(cache, KVCache):
                k, v = cache.update(self.layer_idx, k, v)
            elif cache is not None:  # a transformers Cache (generate's DynamicCache, StaticCache, ...)
                k, v = cache.update(k, v, self.layer_idx)
            o = padded_attention(q, k, v, key_mask, scale=self.scale, causal=True, backend=self.backend)
        return self.o_proj(o.transpose(1, 2).reshape(bsz, seq, -1))


class TextMLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TextAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = TextMLP(cfg)

    def forward(self, x, cos, sin, key_mask=None, cache=None, cu_seqlens=None, attn_override=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, key_mask, cache, cu_seqlens, attn_override)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """``model``: token embeddings, decoder layers and the final norm (no lm_head)."""

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gradient_checkpointing = False

    def forward(self, inputs_embeds, cos, sin, key_mask=None, cache=None, cu_seqlens=None, attn_override=None):
        x = inputs_embeds
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(layer, x, cos, sin, key_mask, None, cu_seqlens, attn_override, use_reentrant=False)
            else:
                x = layer(x, cos, sin, key_mask, cache, cu_seqlens, attn_override)
        if isinstance(cache, KVCache):
            cache.advance(inputs_embeds.shape[1])
        return self.norm(x)
