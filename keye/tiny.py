"""The embedded default model ``keye-tiny``: a few-million-parameter Keye-VL-1.5-style model trained
on the synthetic video-QA set that ships with the repo: its vision tower pretrained contrastively
(``training/pretrain_vision.py``), then the SFT recipe in three stages
(``training/configs/tiny_synth_stage0.yaml``, ``tiny_synth_stage1.yaml``, ``tiny_synth.yaml``). It answers
multiple-choice questions with the option's text and other questions with a number.

It lives inside the package (``keye/assets/keye-tiny``) so the demo, ``keye chat``, evaluation and the
training recipes run offline on a laptop CPU. ``python training/build_tiny.py --install`` is the exact
command that rebuilt it.
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


def load_tiny(device: str = "cpu"):
    """Return ``(model, processor)`` of keye-tiny, ready for ``model.generate(**processor(messages))``."""
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor

    d = tiny_dir()
    return KeyeVL.from_pretrained(d, torch_dtype="float32", device=device), KeyeProcessor.from_pretrained(d)
