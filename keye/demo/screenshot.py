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


def screenshot(
    url: str,
    out: str | Path,
    *,
    wait_for: str | None = None,
    timeout: float = 120.0,
    size: tuple[int, int] = (1280, 1600),
    settle: float = 1.0,
    browser: str | None = None,
) -> Path:
    """Open ``url`` in headless Chromium, wait until the page text contains ``wait_for`` (if given), then
    ``settle`` more seconds, and write a full-window PNG of ``size`` (width, height) to ``out``.

    Raises :class:`KeyeConfigError` when no browser is installed, the browser dies, or ``wait_for`` does
    not appear within ``timeout`` seconds (the message quotes the end of the page text).
    """
    exe = browser or find_browser()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Chromium's helper processes may still flush into the profile as they exit; a leftover file there
    # must not turn a good screenshot into an error.
    with tempfile.TemporaryDirectory(prefix="keye_chromium_", ignore_cleanup_errors=True) as profile:
        # Chromium talks on fds 3 (in) and 4 (out). Our pipe ends are first moved to fds >= 10 so the
        # bash's "3<&a 4>&b" can never overwrite one with the other; no preexec_fn (unsafe with threads).
        to_r, to_w = (_high_fd(fd) for fd in os.pipe())  # we write -> browser fd 3
        from_r, from_w = (_high_fd(fd) for fd in os.pipe())  # browser fd 4 -> we read
        cmd = [
            exe,
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
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
        try:
            cdp = _Pipe(proc, to_w, from_r)
            target = cdp.call("Target.createTarget", url="about:blank")["targetId"]
            sid = cdp.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            cdp.call(
                "Emulation.setDeviceMetricsOverride",
                session=sid,
                width=size[0],
                height=size[1],
                deviceScaleFactor=1,
                mobile=False,
            )
            cdp.call("Page.enable", session=sid)
            cdp.call("Page.navigate", session=sid, url=url)
            deadline = time.monotonic() + timeout
            text = ""
            while wait_for is not None:
                res = cdp.call(
                    "Runtime.evaluate",
                    session=sid,
                    expression="document.body ? document.body.innerText : ''",
                    returnByValue=True,
                )
                text = res.get("result", {}).get("value") or ""
                if wait_for in text:
                    break
                if time.monotonic() > deadline:
                    raise KeyeConfigError(
                        f"{wait_for!r} did not appear on {url} within {timeout:g} s; page ends: {text[-300:]!r}"
                    )
                time.sleep(0.5)
            time.sleep(settle)
            data = cdp.call("Page.captureScreenshot", session=sid, format="png")["data"]
            out.write_bytes(base64.b64decode(data))
        finally:
            _close_browser(proc, to_w)
            os.close(to_w)
            os.close(from_r)
    return out


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
