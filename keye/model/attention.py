"""The one place that picks an attention kernel: ``sdpa`` (default), ``eager`` or ``flash_attention_2``.

Two shapes of attention occur in Keye-VL:

- **Varlen / block-diagonal** attention over packed sequences described by ``cu_seqlens``: the vision
  tower (one segment per image, per preview video or per 1.5 frame, never causal) and packed SFT rows
  in the decoder (causal inside each sample). This never builds a dense N x N mask over the whole
  pack: segments of equal length are batched into one kernel call, so memory is that of the largest
  group, not of the pack.
- **Padded batch** attention in the decoder, with a key-padding mask, optional causal masking and a
  KV cache (queries may be fewer than keys; they are the last ``Lq`` positions).

All functions take q, k, v as ``[tokens or B, heads, len, head_dim]`` (see each docstring) and return
the same layout as q.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from keye.errors import KeyeConfigError


@functools.lru_cache(maxsize=1)
def flash_attn_available() -> bool:
    """True when ``flash_attn`` imports (it is an optional extra and needs a CUDA build)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def check_backend(name: str) -> None:
    """Raise :class:`KeyeConfigError` if the backend is unknown or not usable here."""
    if name not in ("sdpa", "eager", "flash_attention_2"):
        raise KeyeConfigError(f"unknown attention backend {name!r}; use 'sdpa', 'eager' or 'flash_attention_2'")
    if name == "flash_attention_2" and not flash_attn_available():
        raise KeyeConfigError(
            "attn_implementation='flash_attention_2' needs the flash-attn package (pip install 'keye[gpu]') "
            "and a CUDA GPU; use 'sdpa' instead"
        )


def _repeat_kv(x: torch.Tensor, n_rep: int, dim: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=dim)


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool = False
) -> torch.Tensor:
    """Plain-math attention with the softmax in float32 (as the official eager path).

    q: [B, H, Lq, d]; k, v: [B, H, Lk, d] (heads already repeated); mask: bool [B or 1, 1, Lq, Lk]
    (True = may attend) or None. ``causal`` aligns the query block to the end of the keys.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    lq, lk = q.shape[-2], k.shape[-2]
    if causal:
        tri = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        mask = tri if mask is None else mask & tri
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _dense(q, k, v, mask, scale, causal, backend) -> torch.Tensor:
    """Attention on [B, H, L, d] tensors with the chosen dense backend (heads already repeated)."""
    if backend == "eager":
        return eager_attention(q, k, v, mask, scale, causal)
    if causal and mask is None and q.shape[-2] == k.shape[-2]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if causal:
        lq, lk = q.shape[-2], k.shape[-2]
        tri = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        mask = tri if mask is None else mask & tri
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Block-diagonal attention over packed segments.

    Args:
        q: [N, Hq, d]; k, v: [N, Hkv, d] with Hq a multiple of Hkv (GQA).
        cu_seqlens: int [S + 1], segment boundaries (0, ..., N).
        causal: causal masking inside each segment (decoder packing) or not (vision tower).
    Returns:
        [N, Hq, d]. No token attends across a segment boundary.
    """
    n_rep = q.shape[1] // k.shape[1]
    if backend == "flash_attention_2":
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_len = int((cu[1:] - cu[:-1]).max())
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal, softmax_scale=scale)
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    out = torch.empty_like(q)
    k = _repeat_kv(k, n_rep, dim=1)
    v = _repeat_kv(v, n_rep, dim=1)
    if len(lengths) == 1:
        qb, kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        return _dense(qb, kb, vb, None, scale, causal, backend)[0].transpose(0, 1)
    # Group equal-length segments so that e.g. all frames of a video run as one batched call;
    # a segment with a unique length is a plain slice (no gather/scatter copies).
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            groups.setdefault(n, []).append(i)
    for n, seg_ids in groups.items():
        if len(seg_ids) == 1:
            a = bounds[seg_ids[0]]
            qb, kb, vb = (x[a : a + n].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            out[a : a + n] = _dense(qb, kb, vb, None, scale, causal, backend)[0].transpose(0, 1)
            continue
        starts = torch.tensor([bounds[i] for i in seg_ids], device=q.device)
        index = (starts[:, None] + torch.arange(n, device=q.device)[None, :]).reshape(-1)
        qb, kb, vb = (x.index_select(0, index).view(len(seg_ids), n, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        ob = _dense(qb, kb, vb, None, scale, causal, backend)
        out.index_copy_(0, index, ob.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
    *, scale: float, causal: bool = True, backend: str = "sdpa",
) -> torch.Tensor:
    """Decoder attention over a (possibly left-padded) batch, with or without a KV cache.

    Args:
        q: [B, Hq, Lq, d], the newest Lq positions; k, v: [B, Hkv, Lk, d] with Lk >= Lq.
        key_mask: bool/int [B, Lk], 1 where the key is a real token, or None (no padding).
    Returns:
        [B, Hq, Lq, d]. Query rows that can see no real key (padding slots) attend to every key of
        their causal window instead of producing NaN; their outputs are meaningless and unused.
    """
    n_rep = q.shape[1] // k.shape[1]
    if backend == "flash_attention_2" and key_mask is None:
        from flash_attn import flash_attn_func

        # flash-attn handles GQA itself and aligns a shorter query block to the end of the keys.
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal, softmax_scale=scale)
        return out.transpose(1, 2)
    k = _repeat_kv(k, n_rep, dim=1)
    v = _repeat_kv(v, n_rep, dim=1)
    if key_mask is None or bool(key_mask.all()):
        return _dense(q, k, v, None, scale, causal, "eager" if backend == "eager" else "sdpa")
    lq, lk = q.shape[-2], k.shape[-2]
    mask = key_mask.bool()[:, None, None, :].expand(-1, 1, lq, lk)
    if causal:
        mask = mask & torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    empty = ~mask.any(dim=-1, keepdim=True)
    if bool(empty.any()):
        mask = mask | empty
    return _dense(q, k, v, mask, scale, False, "eager" if backend == "eager" else "sdpa")
