"""RL trainer beyond the toy (issue 17): a vLLM engine serves the resumed policy and resumes its seed
stream; a mini-batch without loss tokens does not step AdamW (one process, two gloo processes with padded
empty mini-batches, and two where only one rank has tokens: that run equals one process on the other
rank's prompts, weights and metrics); parameters no rank trained stay untouched; dynamic-sampling metrics
are all-rank; the logged learning rate is the one used; a failing rank fails the job instead of hanging
it. The vLLM engine is the recording stand-in of ``tests/train/_fake_vllm.py`` driven through the real
:class:`keye.rl.VLLMRollout`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from keye import KeyeVL
from keye.recipes.rlep import train
from tests.recipes import rl_config
from tests.torchrun import failure_report, job_args, torchrun
from tests.train import _fake_vllm
from tests.train._fake_vllm import fingerprint

REPO = Path(__file__).resolve().parents[2]


def _fake(monkeypatch):
    mod = _fake_vllm.reset()
    monkeypatch.setitem(sys.modules, "vllm", mod)
    return mod


def _weights(ckpt: Path) -> dict[str, float]:
    return fingerprint(KeyeVL.from_pretrained(ckpt, torch_dtype="float32").state_dict())


def test_vllm_engine_serves_the_resumed_policy(tiny_ckpt, rl_set, tmp_path, monkeypatch):
    """Every rollout samples from the policy of the previous step, also right after a resume (the engine is
    built from the start checkpoint, so it must be synced before the first rollout), and the resumed run
    continues the engine's sampling-seed stream: losses and rewards equal the uninterrupted run."""
    fake = _fake(monkeypatch)
    args = ("rollout.engine=vllm", "train.steps=3", "checkpoint.save_every=1", "checkpoint.keep_last=5",
            "replay.M=1")
    full = train(rl_config(tiny_ckpt, rl_set, tmp_path / "a", *args))
    (engine,) = fake.LLM.instances
    policies = [_weights(tiny_ckpt)] + [_weights(tmp_path / f"a/step_{k:08d}/model") for k in (1, 2)]
    assert policies[0] != policies[1] != policies[2]  # the policy moves every step
    assert [g["weights"] for g in engine.generations] == policies

    part = train(rl_config(tiny_ckpt, rl_set, tmp_path / "b", *args), stop_after=2)  # "crash" after step 2
    assert not part["finished"]
    resumed = train(rl_config(tiny_ckpt, rl_set, tmp_path / "b", *args))
    again = fake.LLM.instances[-1]
    assert len(fake.LLM.instances) == 3 and len(again.generations) == 1
    assert again.generations[0]["weights"] == policies[2]  # the resumed policy, not the start checkpoint
    assert again.generations[0]["seed"] == engine.generations[2]["seed"]
    assert resumed["losses"] == full["losses"] and resumed["rewards"] == full["rewards"]
    a = KeyeVL.from_pretrained(tmp_path / "a/final").state_dict()
    b = KeyeVL.from_pretrained(tmp_path / "b/final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _optimizer_state(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    return {f"{i}/{k}": torch.as_tensor(v) for i, s in state.items() for k, v in s.items()}


def test_a_step_without_loss_tokens_leaves_weights_and_adamw_state_alone(tiny_ckpt, rl_set, tmp_path,
                                                                         monkeypatch):
    """Step 2 samples only placeholder ids (scored as text, never trained): its mini-batches hold no loss
    token, so the optimizer must not step; AdamW with the momentum of step 1 and weight decay would move
    every weight without data and advance its step count."""
    fake = _fake(monkeypatch)
    fake.LLM.placeholder_calls = {1}  # the second generate call = step 2's rollouts
    out = tmp_path / "run"
    summary = train(rl_config(tiny_ckpt, rl_set, out, "rollout.engine=vllm", "replay.M=0", "train.steps=2",
                         "algorithm.mini_batches=2", "train.weight_decay=0.1", "checkpoint.save_every=1",
                         "checkpoint.keep_last=3"))
    assert summary["steps"] == 2 and summary["losses"][0] != 0 and summary["losses"][1] == 0
    one, two = out / "step_00000001", out / "step_00000002"
    assert _weights(one / "model") == _weights(two / "model")
    s1, s2 = _optimizer_state(one), _optimizer_state(two)
    assert s1 and s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert any(k.endswith("/exp_avg") and s1[k].abs().sum() > 0 for k in s1)  # step 1 did build momentum


def _job(tiny_ckpt: Path, data: dict[str, Path], out: Path, *overrides: str) -> list[object]:
    """The arguments of one ``_dist_rlep.py`` job."""
    return [out, f"model.path={tiny_ckpt}", f"data.manifest={data['train']}", "data.prompts_per_step=2", "rollout.G=2",
            "rollout.max_new_tokens=4", f"replay.pool={data['pool']}", "train.lr=1e-3", "train.steps=2",
            "log.progress=false", "train.device=cpu", *overrides]


def _launch_jobs(jobs: list[list[object]], *, nproc: int = 2, env: dict[str, str] | None = None,
                 timeout: float = 600) -> subprocess.CompletedProcess:
    """One gloo launch of ``_dist_rlep.py`` on ``nproc`` processes running ``jobs`` in turn."""
    return torchrun(job_args(REPO / "tests/train/_dist_rlep.py", jobs), nproc=nproc, env={"KEYE_LOG_LEVEL": "WARNING", **(env or {})}, timeout=timeout,
                    check=False)


def _launch(tiny_ckpt: Path, data: dict[str, Path], out: Path, *overrides: str, nproc: int = 2,
            env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """One gloo run of ``_dist_rlep.py`` on ``nproc`` processes."""
    return _launch_jobs([_job(tiny_ckpt, data, out, *overrides)], nproc=nproc, env=env, timeout=timeout)


def _checksums(out: Path, nproc: int = 2) -> dict[int, float]:
    """Each rank's parameter checksum of the run in ``out``."""
    return {r: float((out / f"checksum_rank{r}.txt").read_text()) for r in range(nproc)}


def _torchrun(tiny_ckpt: Path, data: dict[str, Path], out: Path, *overrides: str, nproc: int = 2,
              env: dict[str, str] | None = None) -> dict[int, float]:
    """:func:`_launch`, which must succeed; returns each rank's parameter checksum."""
    proc = _launch(tiny_ckpt, data, out, *overrides, nproc=nproc, env=env)
    assert proc.returncode == 0, failure_report(proc)
    return _checksums(out, nproc)


# The 2-process runs of three tests below are the jobs of ONE torchrun launch (each launch costs seconds of
# imports whatever it runs; each train() call seeds its own random state and writes its own folder).
DS = ("replay.M=1", "algorithm.dynamic_sampling=true", "algorithm.max_rounds=1",
      "algorithm.dynamic_sampling_metric=reward")
NO_TOKENS = ("rollout.engine=vllm", "replay.M=0", "train.weight_decay=0.1", "data.shuffle=false")


def _text_manifest(path: Path) -> Path:
    path.write_text("".join(json.dumps({"id": f"t{i}", "answer": str(i), "answer_kind": "numeric",
                                        "messages": [{"role": "user", "content": f"What is {i} plus 0?"}]}) + "\n"
                            for i in range(4)))
    return path


@pytest.fixture(scope="module")
def two_ranks(tiny_ckpt, rl_set, tmp_path_factory) -> Path:
    """``mb2`` / ``mb1``: padded empty mini-batches or not; ``text``: text-only prompts; ``no_tokens``: rank 1
    samples only placeholder ids (``FAKE_VLLM_PLACEHOLDER_RANKS=1`` is set for the launch; only the fake vLLM
    engine reads it, and only the last job uses that engine)."""
    root = tmp_path_factory.mktemp("two_ranks")
    rows = rl_set["train"].read_text().splitlines(keepends=True)
    both = rl_set["train"].parent / "scale_both.jsonl"  # media paths in the rows are relative to that folder
    both.write_text("".join(rows[:4]))
    jobs = [_job(tiny_ckpt, rl_set, root / "mb2", "algorithm.mini_batches=2", *DS),
            _job(tiny_ckpt, rl_set, root / "mb1", "algorithm.mini_batches=1", *DS),
            _job(tiny_ckpt, rl_set, root / "text", f"data.manifest={_text_manifest(root / 'text.jsonl')}",
                 "replay.M=0", "train.weight_decay=0.1", "train.stage=full"),
            _job(tiny_ckpt, rl_set, root / "no_tokens", *NO_TOKENS, f"data.manifest={both}")]
    proc = _launch_jobs(jobs, env={"FAKE_VLLM_PLACEHOLDER_RANKS": "1"})
    assert proc.returncode == 0, failure_report(proc)
    return root


def _step_rows(out: Path) -> list[dict[str, float]]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_two_processes_padded_empty_mini_batches_do_not_step(tiny_ckpt, two_ranks):
    """2 ranks with one group each: ``mini_batches=2`` leaves the second mini-batch empty on both ranks.
    Skipping it makes the run equal to ``mini_batches=1`` (the same single update per step); stepping
    AdamW on the all-reduced zero gradients moved the weights by momentum alone. With one round of
    dynamic sampling each rank generates exactly its one group per step, so the logged counts must be
    the all-rank ones (2 groups per step), not rank 0's."""
    two, one = _checksums(two_ranks / "mb2"), _checksums(two_ranks / "mb1")  # the jobs of the module's launch
    with torch.no_grad():
        start = float(sum(p.double().sum() for p in KeyeVL.from_pretrained(tiny_ckpt).parameters()))
    assert two[0] == two[1] and one[0] == one[1] and two[0] != start
    assert two[0] == one[0]
    rows = _step_rows(two_ranks / "mb2")
    assert [r["dynsample/generated"] for r in rows] == [2.0, 2.0]
    for r in rows:
        assert r["dynsample/kept_frac"] == (r["dynsample/generated"] - r["dynsample/dropped"]) / 2.0


@pytest.mark.slow
def test_a_rank_without_tokens_adds_nothing_to_the_update_or_its_metrics(tiny_ckpt, rl_set, tmp_path,
                                                                         two_ranks):
    """Rank 1 samples only placeholder ids (no loss token), rank 0 ordinary text. The skip decision is taken
    on the all-rank token count, so both ranks step (no deadlock, no divergence); the update is rank 0's
    alone, so the run equals one process fed rank 0's prompts (same step seeds and engine seeds for rank 0),
    weights and token-weighted update metrics included: an empty rank must not dilute entropy or clip
    fractions."""
    rows = rl_set["train"].read_text().splitlines(keepends=True)
    root = rl_set["train"].parent  # media paths in the rows are relative to the manifest's folder
    alone = root / "scale_rank0.jsonl"
    alone.write_text(rows[0] + rows[2])  # without shuffling rank 0 of 2 reads prompts 0, 2, ... of rows[:4]
    two = _checksums(two_ranks / "no_tokens")  # 2 processes on rows[:4], rank 1 placeholder-only
    one = _torchrun(tiny_ckpt, rl_set, tmp_path / "one", *NO_TOKENS, f"data.manifest={alone}",
                    "data.prompts_per_step=1", nproc=1)
    with torch.no_grad():
        start = float(sum(p.double().sum() for p in KeyeVL.from_pretrained(tiny_ckpt).parameters()))
    assert two[0] == two[1] == one[0] != start
    r2, r1 = _step_rows(two_ranks / "no_tokens"), _step_rows(tmp_path / "one")
    assert len(r2) == len(r1) == 2 and all(r["entropy"] > 0 for r in r1)
    for a, b in zip(r2, r1):
        for key in ("loss", "entropy", "clip_frac", "approx_kl", "ratio_mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


def test_logged_learning_rate_is_the_one_each_step_used(tiny_ckpt, rl_set, tmp_path):
    """With a 2-step warmup step 1 updates at lr/2 and step 2 at lr (``lr_lambda``); the metrics row of a
    step reports the rate its updates used, not the next step's (the scheduler advances after the update)."""
    out = tmp_path / "warm"
    train(rl_config(tiny_ckpt, rl_set, out, "train.steps=2", "train.warmup_steps=2", "train.lr=1e-3", "replay.M=0"))
    assert [r["lr"] for r in _step_rows(out)] == pytest.approx([5e-4, 1e-3], rel=1e-12)


@pytest.mark.slow
def test_two_processes_leave_parameters_without_gradient_alone(tiny_ckpt, two_ranks):
    """Text-only prompts never reach the vision tower or the projector, so no rank has a gradient for
    them: as in one process (AdamW skips a parameter whose gradient is None) their weights must stay put.
    Zero-filling the missing gradients before the all-reduce let weight decay shrink them every step."""
    out = two_ranks / "text"  # a job of the module's 2-process launch
    sums = _checksums(out)
    assert sums[0] == sums[1]
    start = KeyeVL.from_pretrained(tiny_ckpt).state_dict()
    final = KeyeVL.from_pretrained(out / "final").state_dict()
    vision = [k for k in start if k.startswith(("visual.", "mlp_AR."))]
    assert vision and all(torch.equal(start[k], final[k]) for k in vision)
    assert not torch.equal(start["lm_head.weight"], final["lm_head.weight"])  # the language model trained


@pytest.mark.slow
def test_a_failing_rank_fails_the_job_instead_of_hanging_it(tiny_ckpt, rl_set, tmp_path):
    """Rank 1's engine raises during its first rollout while rank 0 waits in a collective. The failing
    rank must not wait at the teardown barrier (that hung both ranks until the process-group timeout,
    30 minutes on gloo): the job exits non-zero within seconds, with the error in its output."""
    proc = _launch(tiny_ckpt, rl_set, tmp_path / "fail", "rollout.engine=vllm", "replay.M=0",
                   env={"FAKE_VLLM_FAIL_RANKS": "1"}, timeout=180)
    assert proc.returncode != 0
    assert "fake vLLM engine failure on this rank" in proc.stdout + proc.stderr


def test_tis_correction_in_the_loop_weights_tokens_by_the_engine_learner_ratio(tiny_ckpt, rl_set, tmp_path):
    """``algorithm.tis_cap`` reaches the loss through the learner: the local engine records the log-probs it
    sampled with, which equal the learner's recomputation (same weights, unfiltered sampling), so every
    importance weight is 1 and nothing is clipped; the statistics are logged per step."""
    summary = train(rl_config(tiny_ckpt, rl_set, tmp_path / "tis", "train.steps=2", "algorithm.tis_cap=2.0",
                         "tree.enabled=true"))
    assert summary["finished"]
    rows = [json.loads(x) for x in (tmp_path / "tis/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["tis_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["tis_clip_frac"] == 0.0
        assert row["rollout_logp_abs_diff"] < 1e-4
