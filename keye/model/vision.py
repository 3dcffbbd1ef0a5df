"""SigLIP native-resolution vision tower (``visual.vision_model.*`` in the checkpoints).

Differences from the stock SigLIP vision model, all from the Keye reference:

- Any number of items of any (even) patch grid are packed into one sequence; attention is
  block-diagonal over ``cu_seqlens`` (one segment per image, per preview video, or per 1.5 frame).
- The learned 27x27 position table is resized bilinearly (align_corners=False, no antialias) to each
  item's (h, w) patch grid and tiled over its frames.
- A 2-D rotary embedding (row, column) is applied to q and k in every attention layer, on top of
  the absolute table.
- There is no class token and no pooling head is used (``head.*`` tensors are accepted by the loader
  and ignored).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from keye.config import VisionConfig
from keye.model.attention import varlen_attention
from keye.model.rope import apply_vision_rope, vision_rope_cos_sin


def gelu(name: str):
    """The activation named in a config (``gelu_pytorch_tanh`` in the tower, ``gelu`` = erf form)."""
    if name in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return F.silu
    raise ValueError(f"unsupported activation {name!r}")


class VisionEmbeddings(nn.Module):
    """Patch convolution plus the bilinearly resized absolute position table."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.num_positions_side**2, cfg.hidden_size)

    def position_table(self, h: int, w: int) -> torch.Tensor:
        """The position table resized to an (h, w) patch grid, flattened row-major: [h*w, D]."""
        s = self.cfg.num_positions_side
        table = self.position_embedding.weight.view(1, s, s, -1).permute(0, 3, 1, 2)
        table = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=False)
        return table[0].permute(1, 2, 0).reshape(h * w, -1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> torch.Tensor:
        """pixel_values [N, C, p, p] (raster order per item) -> embeddings [N, D]."""
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(pixel_values.to(dtype)).flatten(1)
        tables: dict[tuple[int, int], torch.Tensor] = {}
        pos = []
        for t, h, w in grid_thw:
            if (h, w) not in tables:
                tables[(h, w)] = self.position_table(h, w)
            pos.append(tables[(h, w)].repeat(int(t), 1))
        return x + torch.cat(pos, dim=0)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.backend = "sdpa"

    def forward(self, x, cu_seqlens, cos, sin):
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_heads, self.head_dim)
        if cos is not None:
            q = apply_vision_rope(q, cos, sin)
            k = apply_vision_rope(k, cos, sin)
        o = varlen_attention(q, k, v, cu_seqlens, scale=self.scale, causal=False, backend=self.backend)
        return self.out_proj(o.reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.act = gelu(cfg.hidden_act)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-LN SigLIP block: x + attn(LN1(x)), then + mlp(LN2(.))."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = VisionAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.self_attn(self.layer_norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.gradient_checkpointing = False

    def forward(self, x, cu_seqlens, cos, sin):
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, cu_seqlens, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cu_seqlens, cos, sin)
        return x


class VisionTransformer(nn.Module):
    """``visual.vision_model``: embeddings -> encoder -> post_layernorm over a packed sequence."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(
        self,
        pixel_values: torch.Tensor,
        grid_thw: Sequence[Sequence[int]],
        segments: Sequence[int] | None = None,
        use_rope: bool = True,
    ) -> torch.Tensor:
        """Encode a pack of items.

        Args:
            pixel_values: [sum(t*h*w), C, p, p], items concatenated in order, raster order inside.
            grid_thw: one (t, h, w) per item, in patch units.
            segments: attention segment lengths (defaults to one segment per item). Their sum must
                equal the number of patches; no attention crosses a segment boundary.
            use_rope: the 2-D rotary embedding (always on in Keye; off only to compare with stock SigLIP).
        Returns:
            [sum(t*h*w), hidden] after ``post_layernorm``.
        """
        grid_thw = [tuple(int(v) for v in g) for g in grid_thw]
        n_patches = sum(t * h * w for t, h, w in grid_thw)
        if pixel_values.shape[0] != n_patches:
            raise ValueError(f"pixel rows ({pixel_values.shape[0]}) != sum of t*h*w over grids ({n_patches})")
        if segments is None:
            segments = [t * h * w for t, h, w in grid_thw]
        cu = torch.tensor([0, *segments], dtype=torch.int64).cumsum(0).to(torch.int32)
        x = self.embeddings(pixel_values, grid_thw)
        cos = sin = None
        if use_rope:
            cos, sin = vision_rope_cos_sin(grid_thw, self.cfg.head_dim, self.cfg.rope_theta, device=x.device)
        x = self.encoder(x, cu, cos, sin)
        return self.post_layernorm(x)


class KeyeVisionModel(nn.Module):
    """``visual``: a wrapper whose only child is ``vision_model`` (the checkpoint's key prefix)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.vision_model = VisionTransformer(cfg)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.vision_model(*args, **kwargs)


def vision_flops(cfg: VisionConfig, grid_thw: Sequence[Sequence[int]], segments: Sequence[int] | None = None) -> float:
    """Forward FLOPs of the tower on a pack (matmuls only; 2 FLOPs per multiply-add)."""
    n = sum(t * h * w for t, h, w in grid_thw)
    segs = segments if segments is not None else [t * h * w for t, h, w in grid_thw]
    d, f, c, p = cfg.hidden_size, cfg.intermediate_size, cfg.num_channels, cfg.patch_size
    per_layer = 2 * n * (4 * d * d + 2 * d * f) + 4 * d * sum(s * s for s in segs)
    return 2 * n * c * p * p * d + cfg.num_hidden_layers * per_layer
