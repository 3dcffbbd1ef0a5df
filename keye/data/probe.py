"""Cheap media probing (PyAV / Pillow headers) with an on-disk cache.

A probe reads only container/stream headers plus, for videos, the first decoded frame (so a file whose
header parses but whose stream does not decode is caught before training). Results - including failures -
are cached in a SQLite file keyed by (absolute path, mtime in ns, size in bytes), so editing or replacing a
file invalidates its entry and many processes (dataloader workers, torchrun ranks) can share one cache.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from keye.data.manifest import MediaRef

# Bump when the MediaInfo fields or their meaning change, so old cache rows are ignored.
_PROBE_VERSION = 1
DEFAULT_FRAME_LIST_FPS = 2.0


@dataclass(frozen=True)
class MediaInfo:
    """What a probe found out about one image or video.

    Attributes:
        kind: ``"image"`` or ``"video"``.
        width, height: pixels of the stored frames (0 when ``error`` is set).
        duration: seconds (0.0 for images).
        fps: average frame rate in frames/s (0.0 for images).
        num_frames: number of frames in the stream (1 for images).
        error: ``None`` when the media is usable, else a one-line reason (missing, unreadable, no video
            stream, first frame does not decode, ...).
    """

    kind: str
    width: int = 0
    height: int = 0
    duration: float = 0.0
    fps: float = 0.0
    num_frames: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when the media can be used."""
        return self.error is None


def default_cache_path() -> Path:
    """``$KEYE_CACHE_DIR/probe.sqlite`` or ``~/.cache/keye/probe.sqlite``."""
    base = os.environ.get("KEYE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "keye")
    return Path(base) / "probe.sqlite"


class ProbeCache:
    """A tiny JSON-valued key/value store in SQLite, safe to share across processes.

    Keys are namespaced (``ns``) so other cheap per-file analyses (e.g. slow/fast frame types) can be cached
    next to probes. Each process opens its own connection lazily (connections are not fork-safe).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None):
        self.path = Path(path) if path is not None else default_cache_path()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(str(self.path), timeout=60.0, check_same_thread=False)
            # WAL lets readers and a writer of several ranks / workers share the file. Switching to it needs
            # an exclusive lock and fails at once ("database is locked", no busy wait) while another process
            # uses the file; the mode persists in the file, so only switch when it is not WAL yet, and treat a
            # lost race as harmless (the default journal is slower, not wrong).
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                except sqlite3.OperationalError:
                    pass
            conn.execute("CREATE TABLE IF NOT EXISTS kv (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
            conn.commit()
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    @staticmethod
    def file_key(ns: str, path: str) -> str | None:
        """The cache key of ``path`` under namespace ``ns``, or ``None`` if the file cannot be stat'ed."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return f"{ns}|{os.path.abspath(path)}|{st.st_mtime_ns}|{st.st_size}"

    def get(self, key: str) -> Any | None:
        """The cached value for ``key`` or ``None``."""
        with self._lock:
            row = self._connect().execute("SELECT v FROM kv WHERE k = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, key: str, value: Any) -> None:
        """Store a JSON-serialisable ``value`` under ``key`` (overwrites)."""
        with self._lock:
            conn = self._connect()
            conn.execute("INSERT OR REPLACE INTO kv (k, v) VALUES (?, ?)", (key, json.dumps(value)))
            conn.commit()

    def __getstate__(self) -> dict[str, Any]:
        # Only the path crosses process boundaries; each process reconnects.
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])


def _probe_image_file(path: str) -> MediaInfo:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            w, h = im.size
            # verify() walks the file structure without a full decode; truncated/garbled files fail here.
            im.verify()
    except FileNotFoundError:
        return MediaInfo("image", error="file not found")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        return MediaInfo("image", error=f"cannot read image: {err}")
    if w <= 0 or h <= 0:
        return MediaInfo("image", error=f"image has size {w}x{h}")
    return MediaInfo("image", width=w, height=h, num_frames=1)


def _probe_video_file(path: str) -> MediaInfo:
    import av

    if not os.path.exists(path):
        return MediaInfo("video", error="file not found")
    try:
        with av.open(path) as container:
            streams = container.streams.video
            if not streams:
                return MediaInfo("video", error="no video stream")
            stream = streams[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif container.duration is not None:
                duration = container.duration / 1_000_000
            else:
                duration = 0.0
            n = int(stream.frames or 0)
            first = next(container.decode(stream), None)
            if first is None:
                return MediaInfo("video", error="video has zero decodable frames")
            w, h = first.width, first.height
            if n <= 0:
                # Some containers (e.g. raw/webm) do not store a frame count; counting packets is cheap.
                container.seek(0)
                n = sum(1 for p in container.demux(stream) if p.size > 0)
    except (av.error.FFmpegError, OSError, ValueError, StopIteration) as err:
        return MediaInfo("video", error=f"cannot decode video: {err}")
    if fps <= 0 and duration > 0:
        fps = n / duration
    if duration <= 0 and fps > 0:
        duration = n / fps
    if n <= 0 or fps <= 0:
        return MediaInfo("video", error=f"video reports {n} frames at {fps} fps")
    return MediaInfo("video", width=w, height=h, duration=duration, fps=fps, num_frames=n)


def _round_fps(x: float) -> float:
    return float(Fraction(x).limit_denominator(1001)) if x > 0 else 0.0


def probe_file(kind: str, path: str, cache: ProbeCache | None = None) -> MediaInfo:
    """Probe one local image or video file, using ``cache`` when given.

    Args:
        kind: ``"image"`` or ``"video"``.
        path: local file path.
        cache: a :class:`ProbeCache`; ``None`` disables caching.

    Returns:
        :class:`MediaInfo`; problems are reported in ``.error``, never raised.
    """
    key = ProbeCache.file_key(f"probe{_PROBE_VERSION}:{kind}", path) if cache is not None else None
    if key is not None:
        hit = cache.get(key)
        if hit is not None:
            return MediaInfo(**hit)
    info = _probe_image_file(path) if kind == "image" else _probe_video_file(path)
    if info.fps:
        info = MediaInfo(**{**asdict(info), "fps": _round_fps(info.fps)})
    if key is not None:
        cache.put(key, asdict(info))
    return info


def probe_media(ref: MediaRef, cache: ProbeCache | None = None) -> MediaInfo:
    """Probe a manifest media reference.

    Frame-list videos probe every frame image (all must exist and share one size); their fps is the item's
    ``fps`` option (default 2.0) and duration = frames / fps. URLs and data URIs are not probed and come back
    with an error (the pipeline needs local files to estimate cost).
    """
    if not ref.is_local:
        return MediaInfo(ref.kind, error="remote media (URL / data URI) cannot be probed; download it first")
    if ref.frames is None:
        return probe_file(ref.kind, ref.path, cache)
    sizes = set()
    for i, frame in enumerate(ref.frames):
        info = probe_file("image", frame, cache)
        if not info.ok:
            return MediaInfo("video", error=f"frame {i} ({frame}): {info.error}")
        sizes.add((info.width, info.height))
    if len(sizes) != 1:
        return MediaInfo("video", error=f"frame-list video mixes frame sizes {sorted(sizes)}")
    (w, h) = sizes.pop()
    fps = float(ref.options.get("fps") or DEFAULT_FRAME_LIST_FPS)
    n = len(ref.frames)
    return MediaInfo("video", width=w, height=h, duration=n / fps, fps=fps, num_frames=n)
