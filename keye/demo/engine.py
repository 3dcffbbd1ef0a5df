"""Loading a checkpoint in the background so the demo page is up (and says so) while weights load."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError, KeyeError
from keye.hub import TINY_NAME as TINY
from keye.hub import resolve_model_path


def add_model_arguments(parser: Any) -> None:
    """Add ``--model`` (a checkpoint directory, hub id or keye-tiny, the default) and ``--device`` to an
    argparse parser, as :class:`ModelHost` takes them (``keye demo``, ``keye chat``, ``keye serve``)."""
    parser.add_argument("--model", default=TINY, help="checkpoint directory, hub id or keye-tiny (default)")
    parser.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")


def resolve_model(name: str | None) -> str:
    """Checkpoint location for ``--model``: ``None`` / ``"keye-tiny"`` -> the embedded keye-tiny directory;
    anything else (a local directory or a hub id ``owner/name``) is returned unchanged.

    Raises :class:`KeyeConfigError` when keye-tiny is asked for but not installed.
    """
    return resolve_model_path(name or TINY)


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def quiet_transformers() -> None:
    """Silence transformers' config warnings (the tokenizer loader reads the checkpoint's config.json,
    whose Keye fields it does not know); for the command-line entry points only."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()


class ModelHost:
    """Owns one model + processor, loaded on a daemon thread by :meth:`start`.

    ``state`` is ``"idle"``, ``"loading"``, ``"ready"`` or ``"failed"`` (``error`` then holds a readable
    reason). ``model`` / ``processor`` are set once ready. Thread-safe to read from request handlers.
    """

    def __init__(self, model: str | None = TINY, device: str | None = None, dtype: str | None = "auto"):
        self.name = model or TINY
        self.device = device or default_device()
        self.dtype = dtype if self.device != "cpu" else "float32"  # bf16 matmuls crawl on most CPUs
        self.state = "idle"
        self.error: str | None = None
        self.model: Any = None
        self.processor: Any = None
        self.load_seconds: float | None = None
        self._ready = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> ModelHost:
        """Begin loading on a background thread (no-op if already started); returns self."""
        with self._lock:
            if self.state != "idle":
                return self
            self.state = "loading"
        threading.Thread(target=self._load, name="keye-demo-load", daemon=True).start()
        return self

    def load_now(self) -> ModelHost:
        """Load in the calling thread; raises the loading error (a :class:`KeyeError`) on failure."""
        with self._lock:
            self.state = "loading"
        self._load()
        if self.state == "failed":
            raise KeyeConfigError(self.error or "model failed to load")
        return self

    def _load(self) -> None:
        t0 = time.perf_counter()
        try:
            from keye.model.keye_vl import KeyeVL
            from keye.processing.processor import KeyeProcessor

            where = resolve_model(self.name)
            processor = KeyeProcessor.from_pretrained(where)
            model = KeyeVL.from_pretrained(where, torch_dtype=self.dtype, device=self.device).eval()
            self.model, self.processor = model, processor
            self.load_seconds = time.perf_counter() - t0
            self.state = "ready"
        except KeyeError as err:
            self.error, self.state = str(err), "failed"
        except Exception as err:  # any loader failure must reach the page, not kill the server thread
            self.error, self.state = f"{err.__class__.__name__}: {err}", "failed"
        finally:
            self._ready.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until loading ended (ready or failed) or ``timeout`` seconds passed; True if ready."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def describe(self) -> str:
        """One line of Markdown for the status bar."""
        label = Path(self.name).name if Path(self.name).is_dir() else self.name
        if self.state == "ready":
            n = self.model.num_parameters()
            size = f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"
            return (
                f"**Model ready:** `{label}` · Keye-VL {self.processor.variant} · {size} parameters · "
                f"{self.device} · loaded in {self.load_seconds:.1f} s"
            )
        if self.state == "failed":
            return f"**Model failed to load:** `{label}`: {self.error}"
        return f"**Loading model** `{label}` on {self.device}... questions wait until it is ready."
