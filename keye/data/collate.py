"""Turning per-sample processor outputs into one micro-batch: a packed row or a padded batch.

Each sample is run through the processor on its own (so one bad sample can be dropped without losing the
others); this module joins the results.

**Packed batch** (``packing=True``, for varlen attention)::

    input_ids      LongTensor [1, T]      all samples' tokens back to back, T = sum(seq_lens)
    labels         LongTensor [1, T]      -100 on prompt / vision / padding tokens (as the processor made them)
    attention_mask LongTensor [1, T]      all ones
    seq_lens       LongTensor [n]         per-sample lengths, in order
    cu_seqlens     IntTensor  [n + 1]     0, cumsum(seq_lens): sample k is tokens cu[k]:cu[k+1]
    position_ids   (only if the processor returned them) concatenated along the last (token) axis
    pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw, ...   every other tensor the
                   processor returned, concatenated along dim 0 in sample order (the model walks grids in
                   order, exactly as for one multi-image sample)

**Padded batch** (``packing=False``): ``input_ids``/``labels``/``attention_mask`` of shape [n, L_max],
right-padded with the pad id / -100 / 0; media tensors concatenated as above; ``seq_lens`` as above.

Both carry ``num_samples`` (int) and ``num_tokens`` (int, real tokens) and ``num_label_tokens`` (int,
labels != -100) for global loss normalisation.
"""

from __future__ import annotations

from typing import Any

import torch

from keye.errors import KeyeInputError

SEQ_KEYS = ("input_ids", "attention_mask", "labels")
IGNORE_INDEX = -100


def _seq_len(out: dict[str, Any]) -> int:
    ids = out["input_ids"]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise KeyeInputError(f"processor returned input_ids of shape {tuple(ids.shape)}, expected [1, L]")
    return int(ids.shape[1])


def _join_other(outs: list[dict[str, Any]], skip: set[str]) -> dict[str, Any]:
    joined: dict[str, Any] = {}
    keys: list[str] = []
    for o in outs:
        keys += [k for k in o if k not in skip and k not in keys]
    for k in keys:
        vals = [o[k] for o in outs if k in o and o[k] is not None]
        if not vals:
            continue
        if all(isinstance(v, torch.Tensor) for v in vals):
            if vals[0].dim() == 0:
                joined[k] = torch.stack(vals)
            else:
                joined[k] = torch.cat(vals, dim=0)
        elif all(isinstance(v, list) for v in vals):
            joined[k] = [x for v in vals for x in v]
        else:
            joined[k] = vals
    return joined


def collate_packed(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """Join per-sample processor outputs (each with ``input_ids`` [1, L_k]) into one packed row (see module)."""
    if not outs:
        raise KeyeInputError("cannot collate an empty micro-batch")
    lens = [_seq_len(o) for o in outs]
    batch: dict[str, Any] = {
        "input_ids": torch.cat([o["input_ids"] for o in outs], dim=1),
        "attention_mask": torch.ones(1, sum(lens), dtype=torch.long),
    }
    if all("labels" in o for o in outs):
        batch["labels"] = torch.cat([o["labels"] for o in outs], dim=1)
    if all("position_ids" in o for o in outs):
        batch["position_ids"] = torch.cat([o["position_ids"] for o in outs], dim=-1)
    seq = torch.tensor(lens, dtype=torch.long)
    batch["seq_lens"] = seq
    batch["cu_seqlens"] = torch.nn.functional.pad(torch.cumsum(seq, 0), (1, 0)).to(torch.int32)
    batch.update(_join_other(outs, set(SEQ_KEYS) | {"position_ids"}))
    _add_counts(batch, lens)
    return batch


def collate_padded(outs: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Join per-sample outputs into a right-padded batch [n, L_max] (see module)."""
    if not outs:
        raise KeyeInputError("cannot collate an empty micro-batch")
    lens = [_seq_len(o) for o in outs]
    n, L = len(outs), max(lens)
    ids = torch.full((n, L), pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, L), dtype=torch.long)
    labels = torch.full((n, L), IGNORE_INDEX, dtype=torch.long)
    for k, (o, ln) in enumerate(zip(outs, lens)):
        ids[k, :ln] = o["input_ids"][0]
        mask[k, :ln] = 1
        if "labels" in o:
            labels[k, :ln] = o["labels"][0]
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if all("position_ids" in o for o in outs):
        pos = [o["position_ids"] for o in outs]
        padded = [torch.nn.functional.pad(p, (0, L - p.shape[-1]), value=1) for p in pos]
        batch["position_ids"] = torch.cat(padded, dim=-2)
    batch["seq_lens"] = torch.tensor(lens, dtype=torch.long)
    batch.update(_join_other(outs, set(SEQ_KEYS) | {"position_ids"}))
    _add_counts(batch, lens)
    return batch


def _add_counts(batch: dict[str, Any], lens: list[int]) -> None:
    batch["num_samples"] = len(lens)
    batch["num_tokens"] = int(sum(lens))
    lab = batch.get("labels")
    batch["num_label_tokens"] = int((lab != IGNORE_INDEX).sum()) if lab is not None else 0
