"""Fixtures for the RL tests: the tiny offline processor and tiny models (preview and 1.5)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def rl_processor(tmp_path_factory):
    """The tiny offline preview processor (token ids match ``tiny_config("preview")``)."""
    from keye.processing.processor import KeyeProcessor
    from keye.testing.processor import make_tiny_processor_dir

    return KeyeProcessor.from_pretrained(make_tiny_processor_dir(tmp_path_factory.mktemp("rl_proc")))


@pytest.fixture(scope="session")
def rl_video(tmp_path_factory):
    """A 12-frame, 10 fps test video (64 x 84)."""
    from keye.testing.processor import make_test_video

    return make_test_video(tmp_path_factory.mktemp("rl_vid") / "clip.mp4", 12, fps=10.0, size=(56, 84))


@pytest.fixture()
def tiny_model():
    from keye.testing.model import make_tiny_model

    return make_tiny_model("preview", seed=0)




@pytest.fixture(scope="package")
def ray_cluster():
    """One local Ray cluster (2 CPUs, no dashboard) for every Ray test of tests/rl: started on first use, shut down
    after the package's last test (each module starting its own cost seconds apiece). Yields the ``ray`` module;
    ``ray.get_runtime_context().gcs_address`` lets a subprocess driver join it."""
    ray = pytest.importorskip("ray")
    from tests.rl import _ray_helpers

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(_ray_helpers)  # the workers cannot import the tests package
    yield ray
    ray.shutdown()
