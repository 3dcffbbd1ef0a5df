"""Fixtures for the data-pipeline tests: a tiny synthetic set made once per session, a probe cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from keye.data.probe import ProbeCache
from keye.data.synth import generate


@pytest.fixture(scope="session")
def synth_dir(tmp_path_factory) -> Path:
    """24 train + 6 test synthetic samples (seed 3), rendered in-process."""
    out = tmp_path_factory.mktemp("synth")
    generate(out, train=24, test=6, seed=3, workers=0, image_fraction=0.25, progress=False)
    return out


@pytest.fixture()
def cache(tmp_path) -> ProbeCache:
    return ProbeCache(tmp_path / "probe.sqlite")
