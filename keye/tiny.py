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

# Name resolution lives in keye.hub (a bottom-layer module); re-exported so ``from keye.tiny import ...`` works.
from keye.hub import TINY_DIR, TINY_NAME, resolve_model_path, tiny_dir

__all__ = ["TINY_DIR", "TINY_NAME", "load_tiny", "resolve_model_path", "tiny_dir"]


def load_tiny(device: str = "cpu"):
    """Return ``(model, processor)`` of keye-tiny, ready for ``model.generate(**processor(messages))``."""
    from keye.model.keye_vl import KeyeVL
    from keye.processing.processor import KeyeProcessor

    d = tiny_dir()
    return KeyeVL.from_pretrained(d, torch_dtype="float32", device=device), KeyeProcessor.from_pretrained(d)
