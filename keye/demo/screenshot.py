"""Screenshot a page with headless Chromium once some text has appeared in it (for the demo's tests and
the README picture).

Chromium's ``--screenshot`` flag fires at the load event (plus a *virtual* time budget), long before a
streamed answer has arrived. Instead we talk to the browser over the DevTools protocol on a pipe
(``--remote-debugging-pipe``: JSON messages separated by NUL bytes on file descriptors 3 and 4, no
websocket library needed), wait in real time until the page's text contains what we expect, then capture.

    python -m keye.demo.screenshot "http://127.0.0.1:7860/?example=0&ask=1" docs/demo.png --wait-for Generated
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_browser() -> str:
    """Path of a Chromium-family browser on PATH; raises :class:`KeyeConfigError` naming the install."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    raise KeyeConfigError(
        "no Chromium browser found on PATH; install it (Debian: apt-get install -y chromium)"
    )


def _high_fd(fd: int) -> int:
    """Move ``fd`` to a descriptor >= 10 (close-on-exec), closing the original."""
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class _Pipe:
    """A DevTools session over Chromium's debugging pipe (requests by id, events skipped)."""

    def __init__(self, proc: subprocess.Popen, to_browser: int, from_browser: int):
        self.proc, self.out, self.inp = proc, to_browser, from_browser
        self.next_id = 0
        self.buf = b""

    def call(self, method: str, timeout: float = 60.0, session: str | None = None, **params: Any) -> dict:
        """Send ``method`` and wait for its reply (events in between are skipped); returns its result."""
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session is not None:
            msg["sessionId"] = session
        os.write(self.out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self.buf:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise KeyeConfigError(f"browser did not answer {method} (exit code {self.proc.poll()})")
                chunk = os.read(self.inp, 1 << 20)
                if not chunk:
                    raise KeyeConfigError(f"browser closed the DevTools pipe during {method}")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise KeyeConfigError(f"DevTools {method} failed: {reply['error']}")
                return reply.get("result", {})


class HeadlessPage:
    """One page of headless Chromium driven over the DevTools pipe, as a context manager::

        with HeadlessPage("http://127.0.0.1:7860/") as page:
            page.wait_for_text("Model ready")
            page.evaluate("document.title")
            page.capture("page.png")

    ``size`` is the window (width, height) in CSS pixels; ``browser`` a browser executable (default:
    :func:`find_browser`). Every failure (no browser, the browser dying, a DevTools error) is a
    :class:`KeyeConfigError`.
    """

    def __init__(self, url: str, *, size: tuple[int, int] = (1280, 1600), browser: str | None = None):
        self.url = url
        self.size = size
        self.exe = browser or find_browser()
        self._cdp: _Pipe | None = None
        self._sid: str | None = None
        self._cleanup: list[Any] = []

    def __enter__(self) -> HeadlessPage:
        # Chromium's helper processes may still flush into the profile as they exit; a leftover file there
        # must not turn a good run into an error.
        profile = tempfile.TemporaryDirectory(prefix="keye_chromium_", ignore_cleanup_errors=True)
        self._cleanup.append(profile.cleanup)
        try:
            self._start(profile.name)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self, profile: str) -> None:
        # Chromium talks on fds 3 (in) and 4 (out). Our pipe ends are first moved to fds >= 10 so the
        # bash's "3<&a 4>&b" can never overwrite one with the other; no preexec_fn (unsafe with threads).
        to_r, to_w = (_high_fd(fd) for fd in os.pipe())  # we write -> browser fd 3
        from_r, from_w = (_high_fd(fd) for fd in os.pipe())  # browser fd 4 -> we read
        cmd = [
            self.exe,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={self.size[0]},{self.size[1]}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{to_r} 4>&{from_w} {to_r}<&- {from_w}>&-', "bash", *cmd],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(to_r, from_w),
            start_new_session=True,  # its own process group: the renderers go with the browser
        )
        os.close(to_r)
        os.close(from_w)

        def close() -> None:
            _close_browser(proc, to_w)
            os.close(to_w)
            os.close(from_r)

        self._cleanup.append(close)
        self._cdp = _Pipe(proc, to_w, from_r)
        target = self._cdp.call("Target.createTarget", url="about:blank")["targetId"]
        self._sid = self._cdp.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=self.size[0], height=self.size[1],
                  deviceScaleFactor=1, mobile=False)
        self.call("Page.enable")
        self.call("Page.navigate", url=self.url)

    def __exit__(self, *exc: Any) -> None:
        while self._cleanup:
            self._cleanup.pop()()

    def call(self, method: str, timeout: float = 60.0, **params: Any) -> dict:
        """Send one DevTools command to the page; returns its result."""
        if self._cdp is None:
            raise KeyeConfigError("the page is not open (use HeadlessPage as a context manager)")
        return self._cdp.call(method, timeout=timeout, session=self._sid, **params)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript ``expression`` in the page (JSON-serialisable values only)."""
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in res:
            raise KeyeConfigError(f"JavaScript error in {expression[:80]!r}: {res['exceptionDetails'].get('text')}")
        return res.get("result", {}).get("value")

    def text(self) -> str:
        """The page's visible text (``document.body.innerText``)."""
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for_text(self, text: str, timeout: float = 120.0) -> str:
        """Wait until the page's text contains ``text``; returns the page text. Raises
        :class:`KeyeConfigError` quoting the end of the page after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            page = self.text()
            if text in page:
                return page
            if time.monotonic() > deadline:
                raise KeyeConfigError(
                    f"{text!r} did not appear on {self.url} within {timeout:g} s; page ends: {page[-300:]!r}"
                )
            time.sleep(0.25)

    def capture(self, out: str | Path) -> Path:
        """Write a PNG of the window to ``out``."""
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        data = self.call("Page.captureScreenshot", format="png")["data"]
        out.write_bytes(base64.b64decode(data))
        return out


def capture(url: str, out: str | Path, *, wait_for: str | None = None, timeout: float = 120.0,
            size: tuple[int, int] = (1280, 1600), settle: float = 1.0, browser: str | None = None) -> tuple[Path, str]:
    """Open ``url`` in headless Chromium, wait until the page text contains ``wait_for`` (if given), then
    ``settle`` more seconds, and write a full-window PNG of ``size`` (width, height) to ``out``. Returns
    ``(out, the page's text at the capture)``.

    Raises :class:`KeyeConfigError` when no browser is installed, the browser dies, or ``wait_for`` does
    not appear within ``timeout`` seconds (the message quotes the end of the page text).
    """
    with HeadlessPage(url, size=size, browser=browser) as page:
        if wait_for is not None:
            page.wait_for_text(wait_for, timeout)
        time.sleep(settle)
        text = page.text()
        return page.capture(out), text


def screenshot(url: str, out: str | Path, *, wait_for: str | None = None, timeout: float = 120.0,
               size: tuple[int, int] = (1280, 1600), settle: float = 1.0, browser: str | None = None) -> Path:
    """:func:`capture` without the page text: the PNG's path."""
    return capture(url, out, wait_for=wait_for, timeout=timeout, size=size, settle=settle, browser=browser)[0]


def _close_browser(proc: subprocess.Popen, to_browser: int) -> None:
    """Ask the browser to quit over the pipe, then end its process group (ours) if it lingers."""
    if proc.poll() is None:
        try:
            os.write(to_browser, json.dumps({"id": 10**9, "method": "Browser.close"}).encode() + b"\0")
            proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            pass  # broken pipe or a hung browser: the group kill below ends it
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # helper processes left in the group we created
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    """``python -m keye.demo.screenshot URL OUT [--wait-for TEXT]``; exit code 1 with a one-line error."""
    p = argparse.ArgumentParser(prog="python -m keye.demo.screenshot", description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--wait-for", default=None, help="text that must be on the page before the capture")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1600)
    args = p.parse_args(argv)
    try:
        path = screenshot(
            args.url, args.out, wait_for=args.wait_for, timeout=args.timeout, size=(args.width, args.height)
        )
    except KeyeConfigError as err:
        print(f"screenshot: error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
