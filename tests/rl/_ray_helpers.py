"""Helpers of tests/rl/test_ray_sync.py, kept light to import: reward scorers that misbehave once (pickled by
value into Ray actors) and one member of a spawned weight-broadcast group.

A scorer misbehaves on the first call that finds its ``marker`` file (it deletes the file first, so exactly one
call misbehaves, whichever worker makes it) as the file says: ``die`` ends the worker process, ``hang`` sleeps
until the driver's timeout kills it. Otherwise it scores deterministically from the text alone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch


def text_score(text: str) -> float:
    """The reward of a response text: a deterministic function that differs between most texts."""
    return float(sum(ord(c) for c in text) % 97) / 97.0


@dataclass
class FlakyScorerFactory:
    """Builds a :class:`FlakyScorer` inside a reward worker."""

    marker: str

    def __call__(self) -> FlakyScorer:
        return FlakyScorer(self.marker)


@dataclass
class FlakyScorer:
    """See the module doc."""

    marker: str

    def __call__(self, samples):
        from keye.rl.rollout.scoring import Scores

        try:
            mode = Path(self.marker).read_text()
            os.unlink(self.marker)
        except FileNotFoundError:
            mode = None
        if mode == "die":
            os._exit(1)
        if mode == "hang":
            time.sleep(3600)
        rewards = [text_score(s.text) for s in samples]
        return Scores(rewards, [r > 0.5 for r in rewards], [{"text": r} for r in rewards])


def arm(marker: Path, mode: str) -> Path:
    """Create ``marker``: the next scorer call misbehaves as ``mode`` (``die`` / ``hang``) says."""
    marker.write_text(mode)
    return marker


def wire_member(rank: int, port: int, out: str) -> None:
    """One member of the spawned weight-broadcast test: rank 0 sends, ranks 1 and 2 receive and save."""
    from safetensors.torch import save_file

    from keye.rl.distributed.weight_sync import broadcast_shards, open_sync_group, receive_shards

    torch.manual_seed(0)  # every member builds the same shards; only rank 0's are sent
    shards = [{"a.weight": torch.randn(3, 4), "a.half": torch.randn(5).to(torch.bfloat16),
               "a.steps": torch.arange(7), "a.mask": torch.rand(2, 3) > 0.5}, {}, {"b.scalar": torch.tensor(2.5)}]
    _, group = open_sync_group("127.0.0.1", port, rank, 3, "gloo", 60.0)
    if rank == 0:
        assert broadcast_shards(group, iter(shards), torch.device("cpu")) == 5
        return
    got = list(receive_shards(group, torch.device("cpu")))
    assert [sorted(g) for g in got] == [sorted(g) for g in shards]
    save_file({k: v.contiguous() for g in got for k, v in g.items()}, f"{out}/rank{rank}.safetensors")
    save_file({k: v.contiguous() for g in shards for k, v in g.items()}, f"{out}/sent.safetensors")
