"""``mlp_AR``: the 2x2 spatial-merge projector from vision width to LLM width.

Within each merged cell (i, j) the four patches are concatenated in (row offset, column offset,
channel) order, channel fastest: [P(2i,2j), P(2i,2j+1), P(2i+1,2j), P(2i+1,2j+1)]. Merged tokens come
out in raster order over (t, i, j). This is *not* Qwen2-VL's window order: Keye keeps plain raster
patches in the processor and regroups here.

- Preview: LayerNorm over the vision width on every patch **before** the merge.
- 1.5: merge first, then LayerNorm over 4x the vision width.
Then Linear -> exact (erf) GELU -> Linear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from keye.config import KeyeVLConfig


def merge_2x2(x: torch.Tensor, grid_thw: Sequence[Sequence[int]], m: int) -> torch.Tensor:
    """[sum(t*h*w), D] raster patches -> [sum(t*h*w)/m^2, m*m*D] merged tokens, item by item."""
    out = []
    start = 0
    for t, h, w in grid_thw:
        n = t * h * w
        item = x[start : start + n].view(t, h // m, m, w // m, m, -1)
        out.append(item.permute(0, 1, 3, 2, 4, 5).reshape(t * (h // m) * (w // m), -1))
        start += n
    return torch.cat(out, dim=0)


class Projector(nn.Module):
    """``mlp_AR.{pre_norm, linear_1, linear_2}``."""

    def __init__(self, cfg: KeyeVLConfig):
        super().__init__()
        v = cfg.vision
        self.merge = v.spatial_merge_size
        self.post_merge_norm = cfg.variant == "1.5"
        merged = v.hidden_size * self.merge**2
        self.pre_norm = nn.LayerNorm(merged if self.post_merge_norm else v.hidden_size, eps=cfg.projector_ln_eps)
        self.linear_1 = nn.Linear(merged, merged)
        self.linear_2 = nn.Linear(merged, cfg.text.hidden_size)

    def forward(self, x: torch.Tensor, grid_thw: Sequence[Sequence[int]]) -> torch.Tensor:
        """Tower output [sum(t*h*w), Dv] -> LLM features [sum(t*h*w)/4, D_llm], items in order."""
        if self.post_merge_norm:
            x = self.pre_norm(merge_2x2(x, grid_thw, self.merge))
        else:
            x = merge_2x2(self.pre_norm(x), grid_thw, self.merge)
        return self.linear_2(F.gelu(self.linear_1(x)))
