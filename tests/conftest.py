"""Shared test fixtures: the golden reference files (kept in ``tests/fixtures``), CPU thread settings, and the tiny
checkpoint and small synthetic / RL sets the recipe tests of every folder use (built once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.paths import GOLDEN_PREVIEW
from tests.recipes import make_at_set, make_rl_set

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


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random tiny Keye-VL-1.5 checkpoint with processor files."""
    from keye.testing.model import save_tiny_checkpoint
    from keye.testing.processor import make_tiny_processor_dir

    d = tmp_path_factory.mktemp("tiny_ckpt")
    make_tiny_processor_dir(d, variant="1.5")
    save_tiny_checkpoint(d, "1.5", seed=0)
    return d


@pytest.fixture(scope="session")
def synth_set(tmp_path_factory) -> dict[str, Path]:
    """A small synthetic video-QA set: 40 training and 8 test questions (seed 0)."""
    from keye.data.synth import generate

    return generate(tmp_path_factory.mktemp("synth"), train=40, test=8, seed=0, workers=1, progress=False)


@pytest.fixture(scope="session")
def rl_set(synth_set) -> dict[str, Path]:
    """The RL manifest, test questions and replay pool of :func:`tests.recipes.make_rl_set`."""
    return make_rl_set(synth_set)


@pytest.fixture(scope="session")
def at_set(synth_set) -> dict[str, Path]:
    """The AutoThink manifest and pool of :func:`tests.recipes.make_at_set`."""
    return make_at_set(synth_set)
