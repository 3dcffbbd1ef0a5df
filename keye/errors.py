"""Typed exceptions shared by every part of keye.

Each error carries enough context (the file, the item or sample index, the reason) to be acted on
without a traceback: ``str(err)`` is a complete, human-readable sentence.
"""

from __future__ import annotations

from typing import Any


class KeyeError(Exception):
    """Base class of every error keye raises on purpose."""


class KeyeConfigError(KeyeError, ValueError):
    """A configuration (config.json, YAML recipe, dataclass field) is invalid or inconsistent."""


class KeyeWeightsError(KeyeError, ValueError):
    """A checkpoint cannot be loaded: missing/unexpected tensors, wrong shapes, unreadable files."""


class KeyeInputError(KeyeError, ValueError):
    """Bad user input to the processor, data pipeline or model.

    Args:
        reason: what is wrong, as a sentence fragment ("video has zero decodable frames").
        path: the file involved, if any.
        item: the message item / sample index / content entry involved, if any.
    """

    def __init__(self, reason: str, *, path: Any = None, item: Any = None):
        self.reason = reason
        self.path = None if path is None else str(path)
        self.item = item
        parts = []
        if self.path is not None:
            parts.append(f"{self.path}")
        if item is not None:
            parts.append(f"item {item}")
        prefix = ": ".join(parts)
        super().__init__(f"{prefix}: {reason}" if prefix else reason)
