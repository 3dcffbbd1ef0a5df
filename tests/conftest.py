"""Shared test fixtures: the golden reference files (kept in ``tests/fixtures``) and CPU thread settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.paths import GOLDEN_PREVIEW

# Every test runs with this many torch CPU threads (whatever OMP_NUM_THREADS says): tests that compare a run in
# another process (a Ray actor, a subprocess) with one in this process give that process the same count, since
# CPU float reductions depend on it.
TORCH_THREADS = 2


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Small CPU tests run faster and more reproducibly on few threads.
    torch.set_num_threads(TORCH_THREADS)
    yield


@pytest.fixture(scope="session")
def golden_preview_dir() -> Path:
    assert GOLDEN_PREVIEW.is_dir(), f"golden fixtures not found at {GOLDEN_PREVIEW}"
    return GOLDEN_PREVIEW
