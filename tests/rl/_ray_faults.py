"""Reward scorers that misbehave once, for the Ray reward-worker fault tests (pickled by value into the actors).

A scorer misbehaves on the first call that finds its ``marker`` file (it deletes the file first, so exactly one
call misbehaves, whichever worker makes it) as the file says: ``die`` ends the worker process, ``hang`` sleeps
until the driver's timeout kills it. Otherwise it scores deterministically from the text alone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


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
        from keye.rl.scoring import Scores

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
