"""A long packed SFT row made without the processor: one Keye-VL-1.5 video sample and text samples.

Used by the context-parallel tests and ``benchmarks/context_parallel.py``: the row has the layout the processor
and packing collate produce (``input_ids`` [1, L] with one ``<|video_pad|>`` run per frame, ``labels`` with -100
outside the answers, ``seq_lens``), so positions, the vision split and the loss see what training sees.
"""

from __future__ import annotations

from typing import Any

import torch

from keye.config import KeyeVLConfig


def long_video_row(config: KeyeVLConfig, *, frames: int = 4, frame_grid: tuple[int, int] = (4, 4),
                   text_lens: tuple[int, ...] = (40, 24), video_text: int = 12, answer: int = 10,
                   seed: int = 0) -> dict[str, Any]:
    """One packed row: a video sample (``video_text`` prompt tokens, then per frame a vision-start token and the
    frame's ``h*w/4`` placeholders, then an ``answer`` of that many labelled tokens) followed by one text sample
    per ``text_lens`` entry (its second half labelled). ``frame_grid`` is (h, w) in patches, multiples of the
    merge size. Token ids are drawn below the special tokens with ``seed``; pixel values are standard normal.

    Returns:
        ``input_ids`` / ``labels`` [1, L], ``seq_lens`` (list), ``pixel_values_videos`` [frames*h*w, C, p, p],
        ``video_grid_thw`` [[frames, h, w]], and the packing collate's ``packed`` (True), ``num_tokens`` (L),
        ``num_samples`` and ``num_label_tokens`` (labels other than -100): a loader micro-batch.
    """
    g = torch.Generator().manual_seed(seed)
    low = min(config.bos_token_id, config.image_token_id, config.video_token_id, config.vision_start_token_id)
    h, w = frame_grid
    m = config.vision.spatial_merge_size

    def words(n: int) -> list[int]:
        return torch.randint(0, low, (n,), generator=g).tolist()

    ids: list[int] = words(video_text)
    for _ in range(frames):
        ids += [config.vision_start_token_id] + [config.video_token_id] * (h * w // (m * m))
    prompt = len(ids)
    ids += words(answer)
    labels = [-100] * prompt + ids[prompt:]
    seq_lens = [len(ids)]
    for n in text_lens:
        sample = words(n)
        ids += sample
        labels += [-100] * (n // 2) + sample[n // 2 :]
        seq_lens.append(n)
    v = config.vision
    pixels = torch.randn(frames * h * w, v.num_channels, v.patch_size, v.patch_size, generator=g)
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]), "seq_lens": seq_lens,
            "pixel_values_videos": pixels, "video_grid_thw": torch.tensor([[frames, h, w]]), "packed": True,
            "num_tokens": len(ids), "num_samples": len(seq_lens), "num_label_tokens": sum(x != -100 for x in labels)}


__all__ = ["long_video_row"]
