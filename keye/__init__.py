"""keye: Keye-VL-style video-language models.

The public entry points are imported lazily so that parts with heavy optional dependencies (training,
demo) load only when used. Importing keye registers the Keye-VL config, model and processor classes
with transformers' auto classes (see :mod:`keye.model.auto`), which loads torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "KeyeVL": "keye.model.keye_vl",
    "KeyeVLConfig": "keye.config",
    "KeyeVL1_5Config": "keye.config",
    "VisionConfig": "keye.config",
    "TextConfig": "keye.config",
    "KeyeProcessor": "keye.processing.processor",
    "load_tiny": "keye.tiny",
    "KeyeError": "keye.errors",
    "KeyeInputError": "keye.errors",
    "KeyeConfigError": "keye.errors",
    "KeyeWeightsError": "keye.errors",
}

__all__ = sorted(_LAZY) + ["__version__"]

def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keye' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def _register() -> None:
    from keye.model.auto import register_auto_classes

    register_auto_classes()


_register()
