"""Fetch the media of a chat request (``image_url`` / ``video_url`` parts) into local files.

Accepted sources:

- ``http://`` / ``https://`` URLs, downloaded with a timeout and a size cap;
- ``data:<mime>;base64,<payload>`` URIs, with the same size cap on the decoded bytes;
- local paths (plain or ``file://``) only under the folders the server was started with
  (``--allow-local-media DIR``): a server must not read arbitrary files for whoever can reach it.

Every failure is an :class:`~keye.serve.errors.APIError` with a 4xx status naming the request field and
the reason (unreachable URL: 400, too large: 413, local files not allowed: 403).
"""

from __future__ import annotations

import base64
import binascii
import mimetypes
import os
import re
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from keye.serve.errors import APIError

_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)
_DEFAULT_SUFFIX = {"image": ".png", "video": ".mp4"}


@dataclass
class MediaPolicy:
    """Limits on fetched media.

    ``max_bytes``: cap on one item's size (downloaded or decoded); ``timeout``: seconds for one download;
    ``allowed_dirs``: folders whose files may be named by local path (empty: local paths refused).
    """

    max_bytes: int = 32 * 1024 * 1024
    timeout: float = 10.0
    allowed_dirs: list[Path] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.allowed_dirs = [Path(d).resolve() for d in self.allowed_dirs]


def _suffix(mime: str | None, kind: str, url_path: str = "") -> str:
    ext = Path(url_path).suffix
    if ext and len(ext) <= 6:
        return ext
    guess = mimetypes.guess_extension(mime or "") if mime else None
    return guess or _DEFAULT_SUFFIX[kind]


def _too_large(param: str, policy: MediaPolicy) -> APIError:
    return APIError(413, f"{param}: the media is larger than the server's limit of {policy.max_bytes} bytes",
                    param=param, code="media_too_large")


def _write(data: bytes, workdir: Path, suffix: str) -> Path:
    fd, name = tempfile.mkstemp(dir=workdir, suffix=suffix)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return Path(name)


def _from_data_uri(url: str, kind: str, param: str, policy: MediaPolicy, workdir: Path) -> Path:
    m = _DATA_URI.match(url)
    if m is None or not m.group("b64"):
        raise APIError(400, f"{param}: a data URI must look like 'data:<mime>;base64,<payload>'", param=param)
    payload = url[m.end():]
    if len(payload) * 3 // 4 > policy.max_bytes + 3:
        raise _too_large(param, policy)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise APIError(400, f"{param}: the data URI's base64 payload does not decode ({err})", param=param) from None
    if not data:
        raise APIError(400, f"{param}: the data URI is empty", param=param)
    return _write(data, workdir, _suffix(m.group("mime"), kind))


def _download(url: str, kind: str, param: str, policy: MediaPolicy, workdir: Path) -> Path:
    req = urllib.request.Request(url, headers={"User-Agent": "keye-serve"})
    try:
        with urllib.request.urlopen(req, timeout=policy.timeout) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > policy.max_bytes:
                raise _too_large(param, policy)
            chunks, size = [], 0
            while True:
                chunk = resp.read(1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > policy.max_bytes:
                    raise _too_large(param, policy)
                chunks.append(chunk)
            mime = resp.headers.get_content_type()
    except APIError:
        raise
    except urllib.error.HTTPError as err:
        raise APIError(400, f"{param}: fetching {url} failed with HTTP {err.code} {err.reason}", param=param,
                       code="media_unreachable") from None
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise APIError(400, f"{param}: could not fetch {url} ({reason})", param=param,
                       code="media_unreachable") from None
    if size == 0:
        raise APIError(400, f"{param}: {url} returned no data", param=param)
    return _write(b"".join(chunks), workdir, _suffix(mime, kind, urlparse(url).path))


def _local(url: str, param: str, policy: MediaPolicy) -> Path:
    if not policy.allowed_dirs:
        raise APIError(403, f"{param}: local file paths are not allowed by this server (start it with "
                       "--allow-local-media DIR to serve files under DIR)", param=param, code="local_media_disabled")
    raw = unquote(urlparse(url).path) if url.startswith("file://") else url
    path = Path(raw).expanduser().resolve()
    if not any(path.is_relative_to(d) for d in policy.allowed_dirs):
        raise APIError(403, f"{param}: {raw} is outside the folders this server may read", param=param,
                       code="local_media_disabled")
    if not path.is_file():
        raise APIError(400, f"{param}: {raw} does not exist or is not a file", param=param)
    if path.stat().st_size > policy.max_bytes:
        raise _too_large(param, policy)
    return path


def fetch_media(url: str, kind: str, param: str, policy: MediaPolicy, workdir: Path) -> Path:
    """Return a local file holding the media at ``url`` (``kind``: ``"image"`` or ``"video"``).

    Downloads and decoded ``data:`` URIs are written under ``workdir`` (the caller deletes it); allowed
    local files are returned in place. ``param`` names the request field in error messages.
    """
    if not isinstance(url, str) or not url.strip():
        raise APIError(400, f"{param}: expected a non-empty URL string", param=param)
    url = url.strip()
    scheme = urlparse(url).scheme.lower()
    if url[:5].lower() == "data:":
        return _from_data_uri(url, kind, param, policy, workdir)
    if scheme in ("http", "https"):
        return _download(url, kind, param, policy, workdir)
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        return _local(url, param, policy)
    raise APIError(400, f"{param}: unsupported URL scheme {scheme!r} (use http(s), data: or an allowed local path)",
                   param=param)
