"""RL trainer beyond the toy (issue 17): a vLLM engine serves the resumed policy, empty mini-batches do not
step AdamW (one process, and two gloo processes where only one rank has tokens), and metrics and resume
stay exact with several ranks. The vLLM engine is the recording stand-in of ``tests/train/_fake_vllm.py``
driven through the real :class:`keye.rl.VLLMRollout`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from keye import KeyeVL
from keye.train.rlep import train
from tests.train import _fake_vllm
from tests.train._fake_vllm import fingerprint
from tests.train.test_rlep import _cfg, rl_set  # noqa: F401 - rl_set is a fixture used by name

REPO = Path(__file__).resolve().parents[2]


def _fake(monkeypatch):
    mod = _fake_vllm.reset()
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


def _weights(ckpt: Path) -> dict[str, float]:
    return fingerprint(KeyeVL.from_pretrained(ckpt, torch_dtype="float32").state_dict())


@pytest.mark.slow
def test_vllm_engine_serves_the_resumed_policy(tiny_ckpt, rl_set, tmp_path, monkeypatch):  # noqa: F811
    """Every rollout samples from the policy of the previous step, also right after a resume (the engine is
    built from the start checkpoint, so it must be synced before the first rollout), and the resumed run
    continues the engine's sampling-seed stream: losses and rewards equal the uninterrupted run."""
    fake = _fake(monkeypatch)
    args = ("rollout.engine=vllm", "train.steps=3", "checkpoint.save_every=1", "checkpoint.keep_last=5",
            "replay.M=1")
    full = train(_cfg(tiny_ckpt, rl_set, tmp_path / "a", *args))
    (engine,) = fake.LLM.instances
    policies = [_weights(tiny_ckpt)] + [_weights(tmp_path / f"a/step_{k:08d}/model") for k in (1, 2)]
    assert policies[0] != policies[1] != policies[2]  # the policy moves every step
    assert [g["weights"] for g in engine.generations] == policies

    part = train(_cfg(tiny_ckpt, rl_set, tmp_path / "b", *args), stop_after=2)  # "crash" after step 2
    assert not part["finished"]
    resumed = train(_cfg(tiny_ckpt, rl_set, tmp_path / "b", *args))
    again = fake.LLM.instances[-1]
    assert len(fake.LLM.instances) == 3 and len(again.generations) == 1
    assert again.generations[0]["weights"] == policies[2]  # the resumed policy, not the start checkpoint
    assert again.generations[0]["seed"] == engine.generations[2]["seed"]
    assert resumed["losses"] == full["losses"] and resumed["rewards"] == full["rewards"]
    a = KeyeVL.from_pretrained(tmp_path / "a/final").state_dict()
    b = KeyeVL.from_pretrained(tmp_path / "b/final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
