"""A text-only training set and a stand-in processor / cost model for the loader's resume and group tests: no
media decoding, so the tests exercise planning, resume and the group broadcast and run in seconds.

The processor turns a conversation into ``input_ids`` of a length set by its text, ``labels``, and a
``pixel_values`` tensor drawn from torch's global RNG (which the loader reseeds per micro-batch), so equal
batches mean equal samples *and* equal preprocessing randomness.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from keye.data.cost import SampleCost


def write_manifest(path: Path, n: int, start: int = 0) -> Path:
    """``n`` text rows (ids ``row-<k>`` from ``start``) of 5-60 words, appended to ``path``."""
    with open(path, "a", encoding="utf-8") as f:
        for k in range(start, start + n):
            words = " ".join(f"w{k}x{j}" for j in range(5 + (k * 37) % 56))
            f.write(json.dumps({"id": f"row-{k}", "messages": [
                {"role": "user", "content": words}, {"role": "assistant", "content": f"answer {k}"}]}) + "\n")
    return path


def _length(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m["content"]).split()) for m in messages) * 3


class TextProcessor:
    """Stand-in processor (see the module docstring); ``calls`` counts the samples it processed here."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, convs: list[list[dict[str, Any]]], **_: Any) -> dict[str, torch.Tensor]:
        self.calls += 1
        n = _length(convs[0])
        ids = torch.arange(n, dtype=torch.long).unsqueeze(0) % 1000
        return {"input_ids": ids, "labels": ids.clone(), "pixel_values": torch.randn(n % 7 + 1, 4)}


class TextCost:
    """Stand-in cost model: the processor's length, FLOPs quadratic in it."""

    def estimate(self, sample: Any) -> SampleCost:
        """Cost of one row."""
        n = _length(sample.messages)
        return SampleCost(n, n, 0, (), 0.0, float(n * n))


def fingerprint(batch: dict[str, Any]) -> list:
    """(epoch, micro-batch, sample ids, hash of every tensor) of one batch, JSON-friendly."""
    h = hashlib.sha1()
    for k in sorted(batch):
        if torch.is_tensor(batch[k]):
            h.update(k.encode() + batch[k].numpy().tobytes())
    return [batch["epoch"], batch["micro_batch"], list(batch["sample_ids"]), h.hexdigest()]
