"""``keye serve``: an OpenAI-compatible HTTP server for Keye models.

- :mod:`keye.serve.protocol` turns an OpenAI chat-completions request into keye messages and sampling
  settings, with errors that name the offending field;
- :mod:`keye.serve.media` fetches ``image_url`` / ``video_url`` parts (http(s), ``data:`` base64, local files
  from allow-listed folders) into local files under size and time limits;
- :mod:`keye.serve.engine` batches concurrent requests (a short collection window, left-padded rows) on
  one generation thread and streams tokens back;
- :mod:`keye.serve.app` is the FastAPI application (``/v1/chat/completions`` with server-sent events,
  ``/v1/models``, ``/health``).
"""

from keye.serve.engine import BatchEngine, EngineConfig
from keye.serve.errors import APIError

__all__ = ["APIError", "BatchEngine", "EngineConfig"]
