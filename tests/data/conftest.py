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


@pytest.fixture(scope="session")
def small_synth(tmp_path_factory) -> Path:
    """12 train samples (seed 5, a quarter image-only): the loader tests decode every sample several times."""
    out = tmp_path_factory.mktemp("synth_small")
    generate(out, train=12, test=0, seed=5, workers=0, image_fraction=0.25, progress=False)
    return out / "train.jsonl"


@pytest.fixture()
def cache(tmp_path) -> ProbeCache:
    return ProbeCache(tmp_path / "probe.sqlite")


@pytest.fixture(scope="session")
def tiny_processor(tmp_path_factory):
    """The tiny offline preview processor (keye.testing.processor)."""
    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    return KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path_factory.mktemp("proc"), "preview"))


@pytest.fixture(scope="session")
def tiny_processor_15(tmp_path_factory):
    """The tiny offline 1.5 (slow/fast) processor."""
    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    return KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path_factory.mktemp("proc15"), "1.5"))
