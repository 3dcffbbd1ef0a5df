"""``keye serve``: an OpenAI-compatible HTTP server for Keye models.

- :mod:`keye.serve.protocol` turns an OpenAI chat-completions request into keye messages and sampling
  settings, with errors that name the offending field;
- :mod:`keye.serve.media` fetches ``image_url`` / ``video_url`` parts (http(s), ``data:`` base64, local files
  from allow-listed folders) into local files under size and time limits;
- :mod:`keye.serve.engine` batches concurrent requests (a short collection window, left-padded rows) on
  one generation thread and streams tokens back;
- :mod:`keye.serve.app` is the FastAPI application (``/v1/chat/completions`` with server-sent events,
  ``/v1/models``, ``/health``).

The names below are imported on first use, so ``keye serve --help`` (which imports :mod:`keye.serve.cli`,
and with it this package) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"BatchEngine": "keye.serve.engine", "EngineConfig": "keye.serve.engine", "APIError": "keye.serve.errors"}

__all__ = ["APIError", "BatchEngine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'keye.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
