"""Fixtures for recipe tests: a tiny 1.5 checkpoint with processor files and a small synthetic set."""

from __future__ import annotations

from pathlib import Path

import pytest

from keye.data.synth import generate
from keye.testing.model import save_tiny_checkpoint
from keye.testing.processor import make_tiny_processor_dir


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_ckpt")
    make_tiny_processor_dir(d, variant="1.5")
    save_tiny_checkpoint(d, "1.5", seed=0)
    return d


@pytest.fixture(scope="session")
def synth_set(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("synth")
    return generate(d, train=40, test=8, seed=0, workers=1, progress=False)
