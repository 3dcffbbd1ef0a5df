"""RL on Ray, sync mode (keye/rl/distributed/): the Ray loop equals the in-process loop for the same seed
(one learner actor exactly, two FSDP2 learner actors within 2e-5), a killed rollout worker is restarted and
its request re-sent without changing the results (a killed and resumed Ray run: tests/rl/test_resume.py), reward
workers that die or hang are replaced and their share re-scored, and the in-process recipe never imports Ray.

The Ray tests share the local cluster of tests/rl/conftest.py's ``ray_cluster`` fixture.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from keye import KeyeVL
from keye.errors import KeyeConfigError
from keye.recipes.rlep import train
from keye.rl import RLPrompt, RolloutSample
from keye.rl.config import RLEPConfig
from keye.rl.learner.learner import Learner, UpdateResult
from keye.rl.rollout.samples import PromptInputs
from keye.train.config import load_config
from tests.conftest import TORCH_THREADS
from tests.recipes import at_config, rl_config
from tests.rl import _ray_helpers

REPO = Path(__file__).resolve().parents[2]

# 2 steps x 2 PPO epochs x 2 mini-batches (the driver plans them), an intermediate checkpoint, held-out evaluation
ARGS = ("train.steps=2", "algorithm.ppo_epochs=2", "algorithm.mini_batches=2", "checkpoint.save_every=1",
        "eval.max_new_tokens=3", "eval.limit=2")
# small actors for a 2-CPU cluster; the same torch thread count as the in-process runs (set per test by
# tests/conftest.py, not read here at import, where OMP_NUM_THREADS would decide it) makes the CPU float
# reductions, hence every number, identical
RAY = ("rl.engine=ray", "rl.ray.learner_cpus=0.5", "rl.ray.rollout_cpus=0.5", "rl.ray.reward_cpus=0.25",
       "rl.ray.reward_workers=1", "rl.ray.placement_timeout_s=60", f"rl.ray.torch_threads={TORCH_THREADS}")


def _rows(run: Path) -> list[dict]:
    """The metrics rows without wall-clock entries."""
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in ("tokens_per_s", "samples_per_s")}
            for r in rows]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return KeyeVL.from_pretrained(path).state_dict()


def _events(run: Path) -> list[dict]:
    f = run / "ray_events.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []


def _assert_released(ray) -> None:
    """The finished run's actors are gone and its placement group removed (the session is collected)."""
    gc.collect()
    deadline = time.time() + 30
    while time.time() < deadline:
        live = [n for n in ray.util.list_named_actors() if n.startswith("keye-")]
        groups = [g["state"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not live and not groups:
            return
        time.sleep(0.2)
    raise AssertionError(f"still held after the run: actors {live}, placement groups {groups}")


@pytest.fixture(scope="module")
def reference(tiny_ckpt, rl_set, tmp_path_factory):
    """The in-process run every Ray run is compared with."""
    out = tmp_path_factory.mktemp("ref") / "run"
    torch.set_num_threads(TORCH_THREADS)  # as inside a test (a module fixture runs before the per-test setting)
    summary = train(rl_config(tiny_ckpt, rl_set, out, *ARGS, f"eval.manifest={rl_set['test']}"))
    return summary, out


@pytest.fixture(scope="module")
def one_actor_run(ray_cluster, tiny_ckpt, rl_set, tmp_path_factory):
    """``reference``'s run on Ray with one learner actor."""
    run = tmp_path_factory.mktemp("ray1") / "ray"
    torch.set_num_threads(TORCH_THREADS)
    return train(rl_config(tiny_ckpt, rl_set, run, *ARGS, f"eval.manifest={rl_set['test']}", *RAY)), run


# ------------------------------------------------------------------------------------------ fast
def test_config_checks_name_the_key():
    from keye.rl.distributed.build import check_ray_config
    from keye.rl.loop.components import build_components
    from keye.train import dist as kdist

    def bad(*over: str, world: int = 1) -> str:
        with pytest.raises(KeyeConfigError) as err:
            check_ray_config(load_config(RLEPConfig, None, ["rl.engine=ray", *over]), world)
        return str(err.value)

    check_ray_config(load_config(RLEPConfig, None, ["rl.engine=ray"]))
    check_ray_config(load_config(RLEPConfig, None, ["rl.engine=ray", "rl.mode=async"]))
    assert "rl.max_staleness must be >= 0" in bad("rl.max_staleness=-1")
    assert "not torchrun" in bad(world=2)
    assert "rl.ray.learners must be >= 1" in bad("rl.ray.learners=0")
    assert "rl.ray.reward_workers must be >= 0" in bad("rl.ray.reward_workers=-1")
    assert "rl.ray.reward_timeout_s must be > 0" in bad("rl.ray.reward_timeout_s=0")
    assert "rl.ray.rollout_cpus must be > 0" in bad("rl.ray.rollout_cpus=0")
    assert "rl.ray.learner_gpus must be >= 0" in bad("rl.ray.learner_gpus=-1")
    assert "rl.ray.num_cpus" in bad("rl.ray.num_cpus=4", "rl.ray.address=auto")
    assert "needs a GPU per rollout worker" in bad("rollout.engine=vllm", "rl.ray.rollout_gpus=0")
    with pytest.raises(KeyeConfigError, match="rl.ray.placement"):
        load_config(RLEPConfig, None, ["rl.ray.placement=ANYWHERE"])
    # the in-process loop is synchronous: asking it for async fails before anything is built
    with pytest.raises(KeyeConfigError, match="rl.mode=async needs rl.engine=ray"):
        build_components(load_config(RLEPConfig, None, ["rl.mode=async"]), kdist.DistInfo(), Path("."), None)


def test_splits_cover_everything_deterministically():
    from keye.rl.distributed.learner_group import assign_groups
    from keye.rl.distributed.ray_session import split_even
    from keye.rl.distributed.rollout_workers import worker_seed

    for n, parts in ((7, 3), (2, 4), (0, 2), (6, 1)):
        spans = split_even(n, parts)
        assert len(spans) == parts and [i for lo, hi in spans for i in range(lo, hi)] == list(range(n))
        assert max(hi - lo for lo, hi in spans) - min(hi - lo for lo, hi in spans) <= 1
    assert worker_seed(12345, 0) == 12345
    assert len({worker_seed(12345, k) for k in range(8)}) == 8 and worker_seed(1, 3) == worker_seed(1, 3)

    prompt = RLPrompt("q", [{"role": "user", "content": "x"}])
    sizes = [5, 1, 1, 4, 2, 2]  # group g has sizes[g] samples of 3 response + 2 prompt tokens
    samples = [RolloutSample(prompt, g, PromptInputs(torch.ones(2, dtype=torch.long)), torch.ones(3, dtype=torch.long),
                             "t", True) for g, k in enumerate(sizes) for _ in range(k)]
    assert assign_groups(samples, 1) == [list(range(len(samples)))]
    shares = assign_groups(samples, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(samples)))
    for share in shares:  # whole groups, batch order kept
        assert share == sorted(share)
        assert all(sum(samples[i].group == g for i in share) in (0, sizes[g]) for g in range(len(sizes)))
    assert sorted(len(s) for s in shares) == [7, 8]  # 5+2 / 4+1+1+2 samples: balanced by tokens
    assert assign_groups(samples, 2) == shares


def test_driver_plan_is_the_learners_own_plan():
    """plan_updates draws the mini-batches Learner.update draws in one process (several epochs, a last
    short mini-batch, an empty one appended)."""
    from types import SimpleNamespace

    from keye.rl.distributed.learner_group import plan_updates

    prompt = RLPrompt("q", [{"role": "user", "content": "x"}])
    samples = [RolloutSample(prompt, g, PromptInputs(torch.ones(2, dtype=torch.long)), torch.ones(2, dtype=torch.long),
                             "t", True) for g in (0, 0, 1, 2, 2, 2, 3, 4)]
    where = {id(s): i for i, s in enumerate(samples)}
    for epochs, mbs in ((2, 2), (3, 4), (1, 1), (1, 6)):
        chosen: list[list[int]] = []

        def record(batch, chosen=chosen, **kw):  # every mini-batch "has no loss token": nothing is stepped
            chosen.append([where[id(s)] for s in batch])

        fake = SimpleNamespace(
            algorithm=SimpleNamespace(ppo_epochs=epochs, mini_batches=mbs), accumulate=record,
            scheduler=SimpleNamespace(get_last_lr=lambda: [0.0], step=lambda: None))
        Learner.update(fake, samples, n_groups=5, seed=77, pad_id=0, use_tree=False, loss_kwargs={})
        assert plan_updates(samples, n_groups=5, seed=77, ppo_epochs=epochs, mini_batches=mbs) == chosen
        assert len(chosen) == epochs * mbs


def test_merged_rank_stats_are_the_union_stats():
    """Per-rank token-weighted means merge into the mean over every rank's tokens; losses (each rank's share
    of a globally normalised loss) add up."""
    from keye.rl.distributed.learner_group import merge_updates

    gen = torch.Generator().manual_seed(0)
    per_rank = [torch.rand(n, generator=gen, dtype=torch.float64) for n in (5, 0, 11)]  # rank 1 has no token
    ratio = [torch.rand(len(t), generator=gen, dtype=torch.float64) + 0.5 for t in per_rank]
    results = []
    for t, r in zip(per_rank, ratio):
        st = {"loss": float(t.sum()) / 16, "tokens": 16.0, "sequences": 4.0, "local_tokens": float(len(t))}
        if len(t):
            st.update(clip_frac=float(t.mean()), ratio_max=float(r.max()), ratio_min=float(r.min()))
        results.append(UpdateResult([st], [0.5], 1, 1e-3))
    merged = merge_updates(results)
    union, uratio = torch.cat(per_rank), torch.cat(ratio)
    st = merged.stats[0]
    assert st["clip_frac"] == pytest.approx(float(union.mean()), rel=1e-12)
    assert st["loss"] == pytest.approx(float(union.sum()) / 16, rel=1e-12)
    assert st["local_tokens"] == 16.0 and st["tokens"] == 16.0
    assert st["ratio_max"] == float(uratio.max()) and st["ratio_min"] == float(uratio.min())
    assert (merged.grad_norms, merged.skipped, merged.lr) == ([0.5], 1, 1e-3)
    from keye.rl.rollout.rollout_manager import WorkerProtocolError

    with pytest.raises(WorkerProtocolError, match="left lockstep"):
        merge_updates([results[0], UpdateResult([], [], 2, 1e-3)])


def test_weight_broadcast_wire_format_is_exact(tmp_path):
    """Shards of several dtypes (float32, bfloat16, int64, bool, a 0-d tensor, an empty shard) arrive bit-exact
    at every receiver of a gloo broadcast group built outside the default process group."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from keye.rl.distributed.ray_session import free_port

    mp.spawn(_ray_helpers.wire_member, args=(free_port(), str(tmp_path)), nprocs=3)
    sent = load_file(str(tmp_path / "sent.safetensors"))
    for rank in (1, 2):
        got = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert set(got) == set(sent)
        for k in sent:
            assert got[k].dtype == sent[k].dtype and got[k].shape == sent[k].shape and torch.equal(got[k], sent[k])


def test_in_process_recipe_does_not_import_ray(tiny_ckpt, rl_set, tmp_path):
    over = [f"model.path={tiny_ckpt}", f"data.manifest={rl_set['train']}", "data.prompts_per_step=1", "rollout.G=2",
            "rollout.max_new_tokens=2", "replay.enabled=false", "train.steps=1", "log.progress=false",
            "train.device=cpu", f"checkpoint.out_dir={tmp_path / 'run'}"]
    code = ("import sys\nfrom keye.recipes.rlep import RLEPConfig, train\nfrom keye.train.config import load_config\n"
            f"s = train(load_config(RLEPConfig, None, {over!r}))\nassert s['finished']\n"
            "print('ray modules:', sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KEYE_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ray modules: []" in proc.stdout, proc.stdout


# ------------------------------------------------------------------------------------------ Ray runs
@pytest.mark.slow
def test_one_learner_actor_equals_one_process(ray_cluster, reference, one_actor_run, tiny_ckpt):
    ref, ref_dir = reference
    got, run = one_actor_run
    assert got["finished"] and got["steps"] == 2 and got["strategy"] == "none"
    # exactly: the same samples, log-probs, updates, metrics, evaluations and final weights
    assert got["losses"] == ref["losses"] and got["rewards"] == ref["rewards"]
    assert got["eval_curve"] == ref["eval_curve"] and len(got["eval_curve"]) == 2
    assert got["param_checksum"] == ref["param_checksum"]
    assert _rows(run) == _rows(ref_dir) and len(_rows(run)) == 4  # 2 steps + 2 evaluations
    a, b = _weights(ref_dir / "final"), _weights(run / "final")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], v) for k, v in _weights(tiny_ckpt).items() if v.numel() > 64)  # it trained
    assert (run / "step_00000001" / "DONE").is_file() and _events(run) == []
    _assert_released(ray_cluster)


@pytest.mark.slow
def test_two_fsdp2_learner_actors_equal_one_process(ray_cluster, reference, tiny_ckpt, rl_set, tmp_path):
    ref, ref_dir = reference
    run = tmp_path / "ray2"
    got = train(rl_config(tiny_ckpt, rl_set, run, *ARGS, *RAY, "rl.ray.learners=2", "train.strategy=fsdp2",
                     "rl.ray.torch_threads=1"))
    assert got["finished"] and got["strategy"] == "fsdp2"
    # the rollouts sample the (numerically equal) updated policy, so they are the same answers
    assert got["rewards"] == ref["rewards"]
    assert got["losses"] == pytest.approx(ref["losses"], abs=2e-5)
    rows = [r for r in _rows(run) if "loss" in r]
    ref_rows = [r for r in _rows(ref_dir) if "loss" in r]
    assert len(rows) == len(ref_rows) == 2
    for r, q in zip(rows, ref_rows):
        assert r["response_length"] == q["response_length"] and r["pass_rate"] == q["pass_rate"]
        assert r["entropy"] == pytest.approx(q["entropy"], abs=2e-5)
        assert r["clip_frac"] == pytest.approx(q["clip_frac"], abs=1e-9)
    a, b = _weights(ref_dir / "final"), _weights(run / "final")
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 2e-5, f"max |2 FSDP2 learner actors - 1 process| = {worst:.3g}"
    _assert_released(ray_cluster)


@pytest.mark.slow
def test_killed_rollout_worker_is_restarted_and_changes_nothing(ray_cluster, reference, tiny_ckpt, rl_set,
                                                                 tmp_path):
    ref, ref_dir = reference
    run = tmp_path / "kill"
    killed: dict[str, int] = {}

    def kill_after_first_step() -> None:
        deadline = time.time() + 600
        while time.time() < deadline:
            f = run / "metrics.jsonl"
            if f.is_file() and any(json.loads(x).get("step") == 1 and "loss" in x for x in f.read_text().splitlines()):
                worker = ray_cluster.get_actor("keye-rollout-0-0")
                killed["pid"] = ray_cluster.get(worker.pid.remote())
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    got = train(rl_config(tiny_ckpt, rl_set, run, *ARGS, *RAY))
    killer.join(timeout=5)
    assert killed, "the rollout worker was not killed during the run"
    events = _events(run)
    assert [e["event"] for e in events] == ["died", "restarted", "requeued"], events
    assert all(e["component"] == "rollout" and e["worker"] == 0 for e in events)
    assert events[-1]["counts"] == {"rollout/died": 1, "rollout/restarted": 1, "rollout/requeued": 1}
    # the replacement served the same weights from the same random state: the run is the uninterrupted one
    assert got["finished"] and got["losses"] == ref["losses"] and got["rewards"] == ref["rewards"]
    steps = [r for r in _rows(run) if "loss" in r]
    assert steps == [r for r in _rows(ref_dir) if "loss" in r]
    a, b = _weights(ref_dir / "final"), _weights(run / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    _assert_released(ray_cluster)


@pytest.mark.slow
def test_reward_workers_that_die_or_hang_are_replaced(ray_cluster, tmp_path):
    from keye.rl.config import RaySection
    from keye.rl.distributed.ray_session import EventLog, RaySession, RayWorkerError
    from keye.rl.distributed.reward_workers import RemoteScorer

    prompt = RLPrompt("q", [{"role": "user", "content": "x"}])
    texts = ["alpha", "b", "gamma ray", "delta", "", "epsilon zeta"]
    samples = [RolloutSample(prompt, i, PromptInputs(torch.ones(3, dtype=torch.long)), torch.ones(2, dtype=torch.long),
                             t, True) for i, t in enumerate(texts)]
    want = [_ray_helpers.text_score(t) for t in texts]
    events = EventLog(tmp_path / "events.jsonl")
    session = RaySession(RaySection(learners=0, rollout_workers=0, reward_workers=2, reward_cpus=0.25), events)
    try:
        marker = tmp_path / "marker"
        scorer = RemoteScorer(session, _ray_helpers.FlakyScorerFactory(str(marker)), 2, timeout_s=4.0, max_restarts=1)
        assert scorer(samples).rewards == want and not events.counts

        _ray_helpers.arm(marker, "die")
        got = scorer(samples)
        assert got.rewards == want and got.passed == [r > 0.5 for r in want]
        assert [p["text"] for p in got.parts] == want
        assert events.counts == {"reward/died": 1, "reward/restarted": 1, "reward/requeued": 1}

        _ray_helpers.arm(marker, "hang")
        t0 = time.time()
        assert scorer(samples).rewards == want
        assert time.time() - t0 >= 4.0  # waited for the timeout, then re-scored the share elsewhere
        assert events.counts["reward/timeout"] == 1 and events.counts["reward/restarted"] == 2
        assert events.counts["reward/requeued"] == 2
        rows = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
        assert [r["event"] for r in rows] == ["died", "restarted", "requeued", "timeout", "restarted", "requeued"]

        scorer.pool.max_restarts = 0
        _ray_helpers.arm(marker, "die")
        with pytest.raises(RayWorkerError, match="score failed 1 times"):
            scorer(samples)
    finally:
        session.close()
    _assert_released(ray_cluster)


@pytest.mark.slow
def test_broadcast_sync_with_two_workers_survives_a_kill(ray_cluster, tiny_ckpt, rl_set, tmp_path, caplog):
    """Two rollout workers (prompts split by index, worker k seeded by worker_seed(step seed, k)), weights
    broadcast over a gloo group of learner rank 0 and the workers: equal to the same run through the object
    store, also when worker 1 is killed mid-run (replaced, group formed again, weights broadcast again)."""
    import logging

    base = ("train.steps=2", "rl.ray.rollout_workers=2", "rl.ray.reward_workers=0", *RAY[:3], RAY[-1])
    store = train(rl_config(tiny_ckpt, rl_set, tmp_path / "store", *base, "rl.ray.weight_sync=object_store"))
    run = tmp_path / "bcast"
    killed: dict[str, int] = {}

    def kill_after_first_step() -> None:
        deadline = time.time() + 600
        while time.time() < deadline and not killed:
            f = run / "metrics.jsonl"
            if f.is_file() and f.read_text().strip():
                worker = ray_cluster.get_actor("keye-rollout-1-0")
                killed["pid"] = ray_cluster.get(worker.pid.remote())
                os.kill(killed["pid"], signal.SIGKILL)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_first_step, daemon=True)
    killer.start()
    with caplog.at_level(logging.INFO, logger="keye.rl.distributed"):
        got = train(rl_config(tiny_ckpt, rl_set, run, *base, "rl.ray.weight_sync=broadcast"))
    killer.join(timeout=5)
    assert killed, "rollout worker 1 was not killed during the run"
    synced = [r.getMessage() for r in caplog.records if "synced to 2 rollout worker(s)" in r.getMessage()]
    assert len(synced) == 2 and all("by gloo broadcast" in m for m in synced), synced
    events = _events(run)
    assert [(e["event"], e["worker"]) for e in events] == [("died", 1), ("restarted", 1), ("requeued", 1)], events
    assert got["losses"] == store["losses"] and got["rewards"] == store["rewards"]
    assert [r for r in _rows(run) if "loss" in r] == [r for r in _rows(tmp_path / "store") if "loss" in r]
    a, b = _weights(tmp_path / "store" / "final"), _weights(run / "final")
    assert all(torch.equal(a[k], b[k]) for k in a)
    _assert_released(ray_cluster)


@pytest.mark.slow
def test_autothink_on_ray_equals_one_process(ray_cluster, tiny_ckpt, at_set, tmp_path):
    """``algorithm.autothink`` on the synchronous Ray engine: the linked auto / /think / /no_think groups are
    sampled by the rollout actor, scored by the reward actor and trained by the learner actor, with the same
    samples, mode-selection rewards, recorded groups and final weights as the in-process run."""
    from keye.rl.algorithms.autothink import GroupLog

    extra = ("train.steps=2", "algorithm.mini_batches=2", "reward.spec={rewards: [accuracy, format]}")
    ref = train(at_config(tiny_ckpt, at_set, tmp_path / "ref", *extra))
    got = train(at_config(tiny_ckpt, at_set, tmp_path / "ray", *extra, *RAY))
    assert got["finished"] and got["steps"] == 2 and "engine: ray" in (tmp_path / "ray" / "config.yaml").read_text()
    assert got["losses"] == ref["losses"] and got["rewards"] == ref["rewards"]
    assert got["param_checksum"] == ref["param_checksum"]
    rows = (tmp_path / "ray" / GroupLog.NAME).read_text()
    assert rows == (tmp_path / "ref" / GroupLog.NAME).read_text() and rows.count("\n") == 4  # 2 steps x 2 questions
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "ref")
    _assert_released(ray_cluster)
