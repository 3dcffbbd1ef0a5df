"""keye: Keye-VL-style video-language models.

The public entry points are imported lazily so that ``import keye`` stays cheap (tens of milliseconds: the
reward workers, the command line and data-loader processes import it) and parts with heavy optional
dependencies load only when used. Importing keye registers the Keye-VL config, model and processor classes
with transformers' auto classes (:mod:`keye.model.auto`): at once when transformers is already imported,
otherwise right after transformers is first imported, so ``import keye`` itself loads neither torch nor
transformers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
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


_registered = False


def _register() -> None:
    """Register the auto classes once. When transformers was first imported by one of keye's own modules
    (``keye.config``, ``keye.model.keye_vl``, ``keye.processing.processor``), that module is still half
    initialised here and the import fails; each of them calls this again at its end, and the last to finish
    registers."""
    global _registered
    if _registered:
        return
    try:
        from keye.model.auto import register_auto_classes

        register_auto_classes()
        _registered = True
    except ImportError:
        pass  # a keye module is mid-import: it retries when it is done
    except Exception as err:  # noqa: BLE001 - a broken registration must not break importing transformers
        _registered = True
        logging.getLogger(__name__).warning("keye could not register its transformers auto classes: %s", err)


class _AfterTransformersImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_register` once transformers' own module has executed (a post-import hook)."""

    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; also lets find_spec below see the real finders
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register()

        spec.loader.exec_module = exec_then_register
        return spec


if "transformers" in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _AfterTransformersImport())
