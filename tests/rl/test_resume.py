"""Kill and resume, once per engine of the one RL loop (keye/recipes/rlep.py): in this process group, on Ray
synchronously, on Ray asynchronously.

A ``keye train rlep`` driver process is killed with SIGKILL right after its step-2 checkpoint; a new run in this
process resumes from the newest checkpoint (the driver may have written none after it) and finishes. The pool grows
online and evicts its oldest entries (``reward.pass_value=0`` makes every fresh answer a success), so a resume
must restore the grown pool to draw the same replays. Synchronous engines end exactly as the uninterrupted
in-process run ends (losses, rewards, pool, final weights). The asynchronous engine's interleaving depends on
timing, so it ends with the same number of trained answers, each trained once, the answers the checkpoint held
trained after it. Every engine's ``metrics.jsonl`` has each step once (rows of steps lost with the driver are cut
back on resume).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from keye import KeyeVL
from keye.recipes.rlep import train
from tests.conftest import TORCH_THREADS
from tests.recipes import rl_config, rl_overrides

pytestmark = pytest.mark.slow

STEPS, PROMPTS, G = 4, 2, 2
ARGS = (f"train.steps={STEPS}", "checkpoint.save_every=2", "checkpoint.keep_last=1", "replay.max_per_question=3",
        "replay.overflow=drop_oldest", "reward.pass_value=0.0")
ENGINES = {
    "process": (),
    "ray-sync": ("rl.engine=ray", "rl.ray.learner_cpus=0.5", "rl.ray.rollout_cpus=0.5", "rl.ray.reward_workers=0",
                 "rl.ray.placement_timeout_s=60", f"rl.ray.torch_threads={TORCH_THREADS}"),
    # answers long enough to be in flight (or waiting for their group) when the checkpoint is written
    "ray-async": ("rl.engine=ray", "rl.mode=async", "rl.max_staleness=1", "rollout.max_new_tokens=24",
                  "rl.ray.torch_threads=1", "rl.ray.reward_workers=0"),
}

_DRIVER = """
import json, sys
import torch
torch.set_num_threads(int(sys.argv[2]))  # as the test process computes (CPU float reductions depend on it)
from keye.recipes.rlep import train
from keye.rl.config import RLEPConfig
from keye.train.config import load_config
train(load_config(RLEPConfig, None, json.loads(sys.argv[1])))
"""


@pytest.fixture(scope="module")
def uninterrupted(tiny_ckpt, rl_set, tmp_path_factory):
    """The in-process run every synchronous engine's resumed run must equal."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    torch.set_num_threads(TORCH_THREADS)  # as inside a test (a module fixture runs before the per-test setting)
    return train(rl_config(tiny_ckpt, rl_set, out, *ARGS)), out


def _kill_after_first_checkpoint(args: list[str], out: Path) -> Path:
    """Start a driver, SIGKILL it once its step-2 checkpoint is complete; returns the newest checkpoint."""
    proc = subprocess.Popen([sys.executable, "-c", _DRIVER, json.dumps(args), str(TORCH_THREADS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "KEYE_LOG_LEVEL": "WARNING"})
    first = out / "step_00000002" / "DONE"
    deadline = time.time() + 300
    while not first.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert first.is_file(), f"the driver wrote no checkpoint: {proc.stderr.read()[-3000:] if proc.poll() else ''}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stderr.close()
    ckpts = sorted(p for p in out.glob("step_*") if (p / "DONE").is_file())
    assert ckpts[-1].name != f"step_{STEPS:08d}" and not (out / "summary.json").exists(), "the driver finished"
    return ckpts[-1]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_killed_driver_resumes_and_ends_as_the_uninterrupted_run(engine, tiny_ckpt, rl_set, uninterrupted, request,
                                                                  tmp_path):
    out = tmp_path / engine
    args = [*ARGS, *ENGINES[engine]]
    driver_args = rl_overrides(tiny_ckpt, rl_set, out, *args)
    if engine != "process":
        gcs = request.getfixturevalue("ray_cluster").get_runtime_context().gcs_address
        driver_args.append(f"rl.ray.address={gcs}")
    ckpt = _kill_after_first_checkpoint(driver_args, out)
    saved = torch.load(ckpt / "loader_rank0.pt", weights_only=False)

    resumed = train(rl_config(tiny_ckpt, rl_set, out, *args))  # the Ray engines join this process's cluster
    assert resumed["finished"] and resumed["steps"] == STEPS
    assert resumed["mode"] == ("async" if engine == "ray-async" else "sync")
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == list(range(1, STEPS + 1)), "a step's metrics row is missing or written twice"

    if engine == "ray-async":
        lines = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
        assert resumed["trained_trajectories"] == len(lines) == STEPS * PROMPTS * G  # as many as uninterrupted
        assert len({x["id"] for x in lines}) == len(lines)  # no answer trained twice
        waiting = {t["id"] for t in saved["trajectories"]["trajectories"]}
        assert waiting, "the checkpoint holds no answer in flight or waiting for its group"
        done = int(ckpt.name.split("_")[1])
        assert waiting <= {x["id"] for x in lines if x["step"] > done}  # the checkpoint's queue went on
        return
    ref, ref_dir = uninterrupted
    assert resumed["rewards"] == ref["rewards"] and resumed["losses"] == ref["losses"]
    assert resumed["pool"] == ref["pool"] and ref["pool"]["pool/entries"] > 8  # the grown pool was restored
    a = KeyeVL.from_pretrained(ref_dir / "final").state_dict()
    b = KeyeVL.from_pretrained(out / "final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
