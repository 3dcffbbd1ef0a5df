"""Rotary position embeddings: the vision tower's 2-D RoPE and the decoder's 3-D mRoPE.

``get_rope_index`` assigns every token of a multimodal sequence its (t, h, w) position exactly as the
official ``get_rope_index`` does (see ``docs/architecture.md`` section 6):

- a text token takes (p, p, p), then p += 1;
- a vision block whose merged grid is (T, H', W') gives token (tau, i, j) the ids
  (p + tpos(tau), p + i, p + j), after which p = 1 + the largest id so far;
- preview videos are one block with tpos(tau) = trunc(float32(tau * s) * tokens_per_second),
  where s is that video's ``second_per_grid_ts`` (1.0 when absent);
- Keye-VL-1.5 videos are one block *per frame* (grid (1, H', W'), tpos = 0);
- with left padding, positions are computed over the attended tokens only, padded slots hold 1, and
  ``rope_delta = (max id + 1) - padded length``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from keye.errors import KeyeInputError


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension split in two halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# ----------------------------------------------------------------------------------------- vision
def vision_rope_cos_sin(
    grid_thw: Sequence[Sequence[int]], head_dim: int, theta: float, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of the vision tower's 2-D RoPE for a pack of items.

    Each patch at in-frame (row, col) gets the angle vector
    ``[row * inv_freq, col * inv_freq]`` (head_dim/2 entries, inv_freq[k] = theta^(-2k/(head_dim/2))),
    repeated twice so that rotate-half pairs dimension j with j + head_dim/2.

    Returns:
        cos, sin: float32 [sum(t*h*w), head_dim].
    """
    rot_dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim))
    pieces = []
    for t, h, w in grid_thw:
        p = torch.arange(h * w, device=device).repeat(int(t))
        rc = torch.stack((p // w, p % w), dim=-1).to(torch.float32)  # [n, 2]
        pieces.append((rc[:, :, None] * inv_freq[None, None, :]).flatten(1))  # [n, rot_dim]
    angles = torch.cat(pieces, dim=0)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, head_dim] in float32 (as the reference) and cast back to x's dtype."""
    xf = x.float()
    out = xf * cos[:, None, :] + rotate_half(xf) * sin[:, None, :]
    return out.to(x.dtype)


# ------------------------------------------------------------------------------------------- text
def text_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Default RoPE inverse frequencies, float32 [head_dim/2]."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponent)


def mrope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, mrope_section: Sequence[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for 3-D mRoPE in the contiguous (Qwen2-VL) layout.

    Frequency k uses the t axis for k < s0, h for s0 <= k < s0+s1, w after; the table is duplicated
    for rotate-half. cos/sin are computed in float32 and cast to ``dtype`` (the reference rotates in
    the activation dtype).

    Args:
        position_ids: int [3, B, L].
    Returns:
        cos, sin: [B, L, head_dim] in ``dtype``.
    """
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)  # [3, B, L, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sections = list(mrope_section) * 2
    chunks = emb.split(sections, dim=-1)
    emb = torch.cat([c[i % 3] for i, c in enumerate(chunks)], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_text_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, L, head_dim] with cos/sin [B, L, head_dim] in x's dtype."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


# ---------------------------------------------------------------------------------- 3-D positions
def split_video_grid(video_grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """Keye-VL-1.5: split merged per-video rows [k, h, w] into k per-frame rows (1, h, w)."""
    if video_grid_thw is None:
        return []
    rows = []
    for t, h, w in video_grid_thw.tolist():
        rows.extend([(1, h, w)] * int(t))
    return rows


class _GridQueue:
    """The vision items of a batch, consumed in order of appearance."""

    def __init__(self, variant, image_grid_thw, video_grid_thw, second_per_grid_ts):
        self.images = [] if image_grid_thw is None else [tuple(r) for r in image_grid_thw.tolist()]
        if variant == "1.5":
            self.videos = split_video_grid(video_grid_thw)
            self.seconds: list[float | None] = [None] * len(self.videos)
        else:
            self.videos = [] if video_grid_thw is None else [tuple(r) for r in video_grid_thw.tolist()]
            if second_per_grid_ts is None:
                self.seconds = [1.0] * len(self.videos)
            else:
                self.seconds = [float(s) for s in torch.as_tensor(second_per_grid_ts).reshape(-1).tolist()]
                if len(self.seconds) != len(self.videos):
                    raise KeyeInputError(
                        f"second_per_grid_ts has {len(self.seconds)} entries but video_grid_thw has "
                        f"{len(self.videos)} videos"
                    )
        self.img_i = 0
        self.vid_i = 0

    def finish(self) -> None:
        if self.img_i != len(self.images):
            raise KeyeInputError(
                f"{len(self.images)} images given but {self.img_i} image placeholder blocks in input_ids"
            )
        if self.vid_i != len(self.videos):
            raise KeyeInputError(
                f"{len(self.videos)} video blocks given but {self.vid_i} video placeholder blocks in input_ids"
            )


def _row_positions(row: np.ndarray, q: _GridQueue, *, image_token_id, video_token_id, m, tokens_per_second, where):
    """(t, h, w) ids [3, n] of one unpadded token sequence, consuming vision items from ``q``."""
    n = row.shape[0]
    pos = np.empty((3, n), dtype=np.int64)
    vis_idx = np.flatnonzero((row == image_token_id) | (row == video_token_id))
    nxt, i, k = 0, 0, 0
    while True:
        while k < len(vis_idx) and vis_idx[k] < i:
            k += 1
        j = int(vis_idx[k]) if k < len(vis_idx) else n
        pos[:, i:j] = nxt + np.arange(j - i)
        nxt += j - i
        if j >= n:
            return pos
        tok = row[j]
        if tok == image_token_id:
            if q.img_i >= len(q.images):
                raise KeyeInputError(f"{where}: more image placeholder blocks than image_grid_thw rows ({len(q.images)})")
            t, h, w = q.images[q.img_i]
            q.img_i += 1
            tpos = np.zeros(t, dtype=np.int64)
        else:
            if q.vid_i >= len(q.videos):
                raise KeyeInputError(f"{where}: more video placeholder blocks than video grid rows ({len(q.videos)})")
            t, h, w = q.videos[q.vid_i]
            s = q.seconds[q.vid_i]
            q.vid_i += 1
            if s is None:
                tpos = np.zeros(t, dtype=np.int64)
            else:
                # float32 maths, then truncation: bit for bit what the reference computes.
                tt = torch.arange(t, dtype=torch.int64) * torch.tensor(s, dtype=torch.float32)
                tpos = (tt * tokens_per_second).long().numpy()
        hh, ww = h // m, w // m
        count = t * hh * ww
        if j + count > n or not np.all(row[j : j + count] == tok):
            kind = "image" if tok == image_token_id else "video"
            raise KeyeInputError(
                f"{where}: {kind} placeholder run at token {j} is shorter than its grid {[t, h, w]} needs "
                f"({count} tokens)"
            )
        ti, hi, wi = np.meshgrid(np.arange(t), np.arange(hh), np.arange(ww), indexing="ij")
        pos[0, j : j + count] = nxt + tpos[ti.reshape(-1)]
        pos[1, j : j + count] = nxt + hi.reshape(-1)
        pos[2, j : j + count] = nxt + wi.reshape(-1)
        nxt = int(pos[:, j : j + count].max()) + 1
        i = j + count


def get_rope_index(
    input_ids: torch.Tensor,
    *,
    image_token_id: int,
    video_token_id: int,
    spatial_merge_size: int,
    variant: str = "preview",
    tokens_per_second: float = 2,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    seq_lens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D mRoPE positions of a batch (or of one packed row).

    Args:
        input_ids: int [B, L] with placeholders already expanded (one per merged vision token).
        image_grid_thw / video_grid_thw: int [n, 3] in patch units, items numbered across the batch
            in order of appearance (row 0 first). For ``variant="1.5"`` video rows may be merged
            [k, h, w] runs of identical frames; they are split per frame.
        second_per_grid_ts: float [n_videos] seconds per temporal step (preview only; default 1.0).
        attention_mask: int [B, L] with 0 on (left) padding, or None.
        seq_lens: packed training: B must be 1 and the row holds consecutive samples of these
            lengths; each sample's positions restart at 0 exactly as if it were alone.
    Returns:
        position_ids: int64 [3, B, L] (padded slots hold 1); rope_deltas: int64 [B, 1]
        (for a packed row, the delta of its last sample).
    Raises:
        KeyeInputError: if placeholder runs and grids disagree.
    """
    bsz, seq_len = input_ids.shape
    ids_np = input_ids.detach().cpu().numpy()
    mask_np = None if attention_mask is None else attention_mask.detach().cpu().numpy().astype(bool)
    q = _GridQueue(variant, image_grid_thw, video_grid_thw, second_per_grid_ts)
    kw = dict(
        image_token_id=image_token_id,
        video_token_id=video_token_id,
        m=spatial_merge_size,
        tokens_per_second=tokens_per_second,
    )
    out = np.ones((3, bsz, seq_len), dtype=np.int64)
    deltas = np.zeros((bsz, 1), dtype=np.int64)
    if seq_lens is not None:
        lens = [int(x) for x in seq_lens]
        if bsz != 1 or sum(lens) != seq_len:
            raise KeyeInputError(f"packed input needs one row whose length ({seq_len}) is sum(seq_lens) ({sum(lens)})")
        start = 0
        for s, n in enumerate(lens):
            pos = _row_positions(ids_np[0, start : start + n], q, where=f"packed sample {s}", **kw)
            out[:, 0, start : start + n] = pos
            deltas[0, 0] = (int(pos.max()) + 1 if n else 0) - n
            start += n
    else:
        for b in range(bsz):
            row = ids_np[b] if mask_np is None else ids_np[b][mask_np[b]]
            pos = _row_positions(row, q, where=f"row {b}", **kw)
            if mask_np is None:
                out[:, b, :] = pos
            else:
                out[:, b, mask_np[b]] = pos
            deltas[b, 0] = (int(pos.max()) + 1 if row.shape[0] else 0) - seq_len
    q.finish()
    device = input_ids.device
    return torch.from_numpy(out).to(device), torch.from_numpy(deltas).to(device)
