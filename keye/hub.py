"""Where a model name points: the embedded ``keye-tiny`` checkpoint's directory, or a path / hub id as given.

This is name resolution only (no torch, no model or processor code), so the bottom-layer packages
(``keye.processing``, ``keye.model``, ``keye.data``, ``keye.rewards``) can name the default checkpoint without
importing :mod:`keye.tiny`, which loads it.
"""

from __future__ import annotations

import os
from pathlib import Path

from keye.errors import KeyeConfigError

TINY_NAME = "keye-tiny"
TINY_DIR = Path(__file__).resolve().parent / "assets" / TINY_NAME


def tiny_dir() -> Path:
    """Directory of the embedded keye-tiny checkpoint (model + processor files)."""
    if not (TINY_DIR / "config.json").is_file():
        raise KeyeConfigError(
            f"{TINY_DIR}: the embedded keye-tiny checkpoint is missing from this install; rebuild it with "
            "python training/build_tiny.py --install"
        )
    return TINY_DIR


def resolve_model_path(name: str | os.PathLike[str]) -> str:
    """Where a ``--model`` / ``model.path`` value points: ``"keye-tiny"`` -> the embedded checkpoint's
    directory (:func:`tiny_dir`, which raises :class:`KeyeConfigError` when it is not installed); anything
    else (a local directory or a hub id ``owner/name``) is returned unchanged, as a string."""
    return str(tiny_dir()) if str(name) == TINY_NAME else str(name)


def _looks_like_hub_id(name: str) -> bool:
    # "owner/name": one slash, not a path that starts at ., / or ~
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and all(name.split("/"))


def resolve_pretrained(name: str | os.PathLike[str], *, error: type[Exception] = KeyeConfigError) -> str:
    """Where a ``from_pretrained`` argument points, for the loaders (``KeyeVL``, ``KeyeProcessor``):
    ``"keye-tiny"`` -> the embedded checkpoint's directory (:func:`resolve_model_path`); an existing path, or
    a hub id ``owner/name``, as given (a hub id is fetched by the loader).

    Anything else raises ``error`` (the loader's own error class) naming ``name`` and what is accepted: a local
    directory, a hub id, or keye-tiny (``keye.load_tiny()``).
    """
    resolved = resolve_model_path(name)
    if Path(resolved).expanduser().exists() or _looks_like_hub_id(resolved):
        return resolved
    raise error(
        f"{name}: no such directory (the path does not exist), and not a hub id 'owner/name' (e.g. "
        f"Kwai-Keye/Keye-VL-1_5-8B); for the "
        f"embedded default model use keye.load_tiny() or the name {TINY_NAME!r}"
    )
