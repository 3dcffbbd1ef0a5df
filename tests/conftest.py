"""Shared test fixtures: paths to the read-only shared facts (spec, golden files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
GOLDEN = SHARED / "golden"
GOLDEN_PREVIEW = GOLDEN / "keye_preview_tiny"


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Small CPU tests run faster and more reproducibly on few threads.
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def golden_preview_dir() -> Path:
    assert GOLDEN_PREVIEW.is_dir(), f"golden fixtures not found at {GOLDEN_PREVIEW}"
    return GOLDEN_PREVIEW
