"""Tests that need a system package pip cannot install (Chromium, FFmpeg's shared libraries).

Outside CI such a test skips with a reason that names what is missing and how to install it; with
``KEYE_REQUIRE_SYSTEM_PACKAGES`` set (``.ci/run`` sets it) a missing package fails the test instead, so CI
never passes by skipping.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_ENV = "KEYE_REQUIRE_SYSTEM_PACKAGES"

# What each optional system dependency is for and the Debian command that provides it (README lists them).
INSTALL = {
    "chromium": "apt-get install -y chromium",
    "ffmpeg": (
        "apt-get install -y libavcodec59 libavformat59 libavutil57 libswscale6 libswresample4 "
        "libavfilter8 libavdevice59"
    ),
}


def required() -> bool:
    """True when missing system packages must fail the test (CI), False when they skip it."""
    return os.environ.get(REQUIRE_ENV, "").strip() not in ("", "0", "false", "no")


def need_system(package: str, available: bool, detail: str) -> None:
    """Skip (or, under ``KEYE_REQUIRE_SYSTEM_PACKAGES``, fail) the calling test when ``available`` is False.

    ``package`` is a key of :data:`INSTALL`; ``detail`` says what the test needs it for. Returns normally
    when the package is available.
    """
    if available:
        return
    msg = f"{detail}: system package {package!r} is missing; install it with `{INSTALL[package]}`"
    if required():
        pytest.fail(f"{msg} ({REQUIRE_ENV} is set, so it is required)")
    pytest.skip(msg)
