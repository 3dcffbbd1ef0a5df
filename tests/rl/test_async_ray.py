"""Asynchronous RL on a local Ray cluster (keye.rl.loop.streaming, the one RL loop's asynchronous batch source):
the staleness bound holds on every trained answer's recorded versions, answers continue across weight updates, a
rollout worker killed by its pid loses nothing, and the learner is the Ray learner group (2 FSDP2 ranks train with
no policy weights in the driver and match 1 rank). A driver killed with SIGKILL and resumed: tests/rl/test_resume.py."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from keye.recipes.rlep import train  # noqa: E402
from keye.rl import ReplayEntry, ReplayPool  # noqa: E402
from keye.rl.config import RLEPConfig  # noqa: E402
from keye.train.config import load_config  # noqa: E402
from tests.recipes import cheapest_rows  # noqa: E402

pytestmark = pytest.mark.slow

B, G, K = 2, 2, 1  # prompts per update, answers per prompt, max staleness


@pytest.fixture(scope="module")
def fx(tiny_ckpt, synth_set) -> dict[str, Path]:
    """The session's tiny 1.5 checkpoint, the 4 cheapest synthetic training questions as an RL manifest and a
    replay pool with one reference answer per question."""
    small = cheapest_rows(synth_set["train"], 4)
    root = synth_set["train"].parent
    manifest = root / "async_train.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in small))
    pool = ReplayPool()
    for r in small:
        pool.add(ReplayEntry(r["id"], r["answer"], None, 1.0, {"source": "reference"}))
    return {"ckpt": tiny_ckpt, "train": manifest, "pool": pool.save_jsonl(root / "async_pool.jsonl")}


def _overrides(fx, out, *extra) -> list[str]:
    # random tiny weights rarely sample an EOS: answers run to max_new_tokens, long enough to be in flight
    # (and cross a weight update) while the learner trains
    return [f"model.path={fx['ckpt']}", f"data.manifest={fx['train']}", f"data.prompts_per_step={B}", f"rollout.G={G}",
            "rollout.max_new_tokens=160", f"replay.pool={fx['pool']}", "replay.M=1", "train.lr=1e-3",
            "algorithm.micro_batch_size=4", f"checkpoint.out_dir={out}", "log.progress=false", "train.device=cpu",
            "rl.engine=ray", "rl.mode=async", f"rl.max_staleness={K}", "train.steps=4", "rl.ray.torch_threads=1",
            "rl.ray.reward_workers=0", *extra]


def _check_log(out: Path, steps: int, k: int) -> list[dict]:
    """Every trained answer of ``trajectories.jsonl``, checked: the expected number, each answer and each
    (group, slot) trained once, whole groups of G, B groups per update, per-token versions never ahead of the
    update and never more than ``k`` behind it."""
    lines = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == steps * B * G
    assert len({x["id"] for x in lines}) == len(lines)
    assert len({(x["group"], x["sample"]) for x in lines}) == len(lines)
    per_group: dict[int, list[int]] = {}
    for x in lines:
        per_group.setdefault(x["group"], []).append(x["sample"])
    assert all(sorted(v) == list(range(G)) for v in per_group.values())
    assert [sum(x["step"] == s for x in lines) for s in range(1, steps + 1)] == [B * G] * steps
    for x in lines:
        spans = x["spans"]
        assert x["version"] == x["step"] - 1
        assert spans[0][1] == 0 and spans[-1][2] == x["tokens"] and x["tokens"] > 0
        assert all(a[2] == b[1] and a[0] < b[0] for a, b in zip(spans, spans[1:]))  # contiguous, versions rise
        assert spans[-1][0] <= x["version"], "a token from a version the learner had not made yet"
        assert x["version"] - spans[0][0] <= k, f"answer {x['id']} is {x['version'] - spans[0][0]} versions stale"
        assert x["start_version"] == spans[0][0]
    return lines


def test_async_run_keeps_the_staleness_bound_and_continues_answers_across_updates(fx, ray_cluster, tmp_path):
    # Answer lengths forced per question (EOS masked before): the first update's questions get 16 tokens, the
    # other questions 400. Batches 0 and 1 are generated together (staleness 1); batch 0 ends after 16 tokens
    # and its update (4 x 16 tokens) ends while batch 1 is a fraction into its 400, so batch 1's answers
    # continue under the new weights whatever the machine's load. (With equal lengths for every answer the
    # next batch's generation and an update took about the same time on a CPU, and whether an answer crossed
    # an update depended on the load.) The first batch is the first B questions of the run's prompt stream.
    from keye.rl import load_rl_prompts
    from keye.rl.loop.state import PromptStream

    first = {q.id for q in PromptStream(load_rl_prompts(fx["train"]), 0, 0, 1, True).draw(B)}

    def length(prompt_id: str, sample: int) -> int:  # a local function: Ray pickles it by value
        return 16 if prompt_id in first else 400

    summary = train(load_config(RLEPConfig, None, _overrides(fx, tmp_path / "a", "rollout.max_new_tokens=400",
                                                                   "algorithm.micro_batch_size=16")),
                          answer_length=length)
    assert summary["mode"] == "async" and summary["finished"] and summary["steps"] == 4
    lines = _check_log(tmp_path / "a", 4, K)
    assert summary["trained_trajectories"] == len(lines) == summary["trajectory_events"]["consumed"]
    hist: dict[int, int] = {}
    for x in lines:
        hist[x["version"] - x["start_version"]] = hist.get(x["version"] - x["start_version"], 0) + 1
    assert summary["staleness"] == hist and max(hist) == K  # the overlap is used
    multi = [x for x in lines if len(x["spans"]) > 1]
    assert multi and summary["partial"] == len(multi), "no answer continued across a weight update"
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(rows) == 4 and all("tis_weight_mean" in r and r["staleness/max"] <= K for r in rows)
    assert (tmp_path / "a" / "final" / "model.safetensors").is_file()

    # max_staleness 0 is on-policy: every trained token was sampled by the weights being updated (and through
    # `keye train rlep`'s entry point: rl.engine=ray rl.mode=async dispatches to the async loop)
    on = train(load_config(RLEPConfig, None, _overrides(fx, tmp_path / "b", "rl.max_staleness=0", "train.steps=2")))
    lines = _check_log(tmp_path / "b", 2, 0)
    assert all(x["spans"] == [[x["version"], 0, x["tokens"]]] for x in lines)
    assert on["staleness"] == {0: 2 * B * G} and on["partial"] == 0


def test_a_rollout_worker_killed_by_its_pid_loses_nothing(fx, ray_cluster, tmp_path):

    killed: dict[str, int] = {}

    def kill_when_busy(run) -> None:
        """SIGKILL the worker as soon as it holds an answer that already has tokens (mid-generation)."""
        pid = run.rollout.workers[0].pid()
        deadline = time.time() + 60
        while time.time() < deadline:
            try:  # the driver thread mutates the manager meanwhile: read, and retry on a torn read
                busy = any(run.trajectories.get(i).num_tokens > 0 for i in run.trajectories.in_flight())
            except (RuntimeError, KeyError):
                busy = False
            if busy:
                os.kill(pid, signal.SIGKILL)
                killed["pid"] = pid
                return
            time.sleep(0.002)

    def on_step(step, run):
        if step == 1:
            threading.Thread(target=kill_when_busy, args=(run,), daemon=True).start()

    out = tmp_path / "kill"
    summary = train(load_config(RLEPConfig, None, _overrides(fx, out, "train.steps=5")), on_step=on_step)
    assert killed, "the worker never held a partly generated answer"
    assert summary["finished"] and summary["trained_trajectories"] == 5 * B * G
    ev, tev = summary["rollout_events"], summary["trajectory_events"]
    assert ev["worker_deaths"] == 1 and ev["restarts"] == 1 and ev["requeued"] >= 1
    assert tev["requeued"] == ev["requeued"] and tev["groups_failed"] == 0 and tev["partial_resumed"] >= 1
    assert json.loads((out / "rollout_workers.json").read_text())["pids"]["0"] != killed["pid"]
    lines = _check_log(out, 5, K)
    assert any(x["retries"] >= 1 for x in lines)  # a requeued answer was finished elsewhere and trained once




def test_a_learner_rank_killed_by_its_pid_is_rebuilt_from_the_last_checkpoint(fx, ray_cluster, tmp_path):
    """The learner process dies after update 2 (SIGKILL by its pid, before that step's checkpoint): the driver
    rebuilds the learner group and the workers, resumes from the step-1 checkpoint (answers in flight back in the
    queue, rows of the lost steps cut), and the run ends with the uninterrupted number of trained answers, each
    trained once; the restart is counted in the summary and logged in ray_events.jsonl."""
    killed: list[int] = []

    def on_step(step, run):
        if step == 2 and not killed:
            pid = run.learner.pids()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    out = tmp_path / "learner"
    summary = train(load_config(RLEPConfig, None, _overrides(fx, out, "checkpoint.save_every=1",
                                                             "checkpoint.keep_last=5")), on_step=on_step)
    assert killed and summary["finished"] and summary["steps"] == 4 and summary["learner_restarts"] == 1
    assert summary["trained_trajectories"] == 4 * B * G
    _check_log(out, 4, K)  # B * G answers per step, each answer once
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1, 2, 3, 4]
    events = [json.loads(x) for x in (out / "ray_events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["component"] == "learner"] == ["died", "restarted"]


def test_dynamic_sampling_replaces_uninformative_groups_and_caps_each_update(fx, ray_cluster, tmp_path):

    # no replay: a random model fails every question, so every group is uninformative by accuracy; each update
    # examines max_rounds * B groups (the admission makes room for a new group per dropped one), trains none,
    # and the run still finishes instead of waiting for groups that can never come
    out = tmp_path / "ds"
    seen: list[list[str]] = []  # the run's actors: the reward is scored by a reward worker here

    def on_step(step, run):
        seen.append(sorted(n for n in ray.util.list_named_actors() if n.startswith("keye-reward-")))

    summary = train(load_config(RLEPConfig, None, _overrides(
        fx, out, "rollout.max_new_tokens=8", "replay.enabled=false", "algorithm.dynamic_sampling=true",
        "algorithm.max_rounds=2", "train.steps=2", "rl.ray.reward_workers=1", "rl.ray.reward_cpus=0.25",
        "rl.ray.learner_cpus=0.5")), on_step=on_step)
    assert seen == [["keye-reward-0-0"]] * 2
    assert summary["finished"] and summary["steps"] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    trained = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()] \
        if (out / "trajectories.jsonl").is_file() else []
    assert len(trained) == summary["trained_trajectories"] == G * sum(r["groups_trained"] for r in rows)
    for r in rows:
        # every examined group is kept (informative: a lucky pass) or dropped; an update stops at 2 * B examined
        assert r["groups_trained"] == B or r["groups_trained"] + r["dynsample/dropped"] == 2 * B
    assert sum(r["dynsample/dropped"] for r in rows) >= 1
    ev = summary["trajectory_events"]
    # the dropped groups were forgotten, not trained; and admission kept going past the first B groups
    assert ev["groups_consumed"] == sum(r["dynsample/dropped"] + r["groups_trained"] for r in rows) > B


def _assert_released() -> None:
    """The finished run's learner actors are gone and their placement group removed."""
    deadline = time.time() + 30
    while time.time() < deadline:
        live = [n for n in ray.util.list_named_actors() if n.startswith("keye-learner-")]
        groups = [g["state"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not live and not groups:
            return
        time.sleep(0.2)
    raise AssertionError(f"still held after the run: actors {live}, placement groups {groups}")


def test_two_fsdp2_learner_ranks_train_while_the_driver_holds_no_policy_weights(fx, ray_cluster, tmp_path):
    import gc

    from keye.model.keye_vl import KeyeVL
    from keye.rl.distributed.learner_group import RemoteLearner

    seen: list[dict] = []

    def models() -> set[int]:
        # type(), not isinstance: isinstance warns on torch's deprecated module proxies
        return {id(o) for o in gc.get_objects() if type(o) is KeyeVL}

    gc.collect()
    before = models()  # models other tests of the session still hold (module fixtures) are not the run's

    def on_step(step, run):
        """What the driver holds while the run goes on: the learner group's proxy, no model of its own, no
        process group."""
        seen.append({"remote": isinstance(run.learner, RemoteLearner), "pids": run.learner.pids(),
                     "models": len(models() - before), "dist": torch.distributed.is_initialized()})

    out = tmp_path / "fsdp2"
    summary = train(load_config(RLEPConfig, None, _overrides(
        fx, out, "rollout.max_new_tokens=16", "train.steps=2", "rl.ray.learners=2", "train.strategy=fsdp2",
        "rl.ray.learner_cpus=0.5")), on_step=on_step)
    assert summary["finished"] and summary["steps"] == 2
    assert summary["strategy"] == "fsdp2" and summary["learner_ranks"] == 2 and summary["world_size"] == 1
    assert math.isfinite(summary["param_checksum"]) and all(math.isfinite(x) for x in summary["losses"])
    _check_log(out, 2, K)
    assert len(seen) == 2
    for s in seen:
        assert s["remote"] and s["models"] == 0 and not s["dist"], s
        assert len(set(s["pids"])) == 2 and os.getpid() not in s["pids"]
    assert (out / "final" / "model.safetensors").is_file() and (out / "step_00000002" / "DONE").is_file()
    _assert_released()


def test_two_fsdp2_learner_ranks_equal_one_rank_at_staleness_zero(fx, ray_cluster, tmp_path):
    """Two runs that differ only in the learner group (2 FSDP2 ranks vs 1 rank, strategy none) end with the
    same parameters (max |difference| < 2e-5), the learner being world-invariant (keye/rl/learner/learner.py).

    Made deterministic so that both runs train the same samples: ``rl.max_staleness=0`` (every update waits
    for its own B groups, all sampled by the weights being updated: no answer crosses an update), one rollout
    worker (one sampling generator, seeded identically in both runs, sees the same requests in the same
    order), and fixed answer lengths (``AnswerLengths`` with sigma 0: every answer of a batch ends on the same
    token, so rows never leave a batch at a timing-dependent point). The sampled tokens then depend only on
    the weights, which agree to float rounding."""
    from safetensors.torch import load_file

    from keye.rl.rollout.stream_worker import AnswerLengths

    lengths = AnswerLengths(mu=math.log(16), sigma=0.0, max_tokens=16)
    # held-out evaluation after every update: the driver's copy is refreshed from the learner group's shards
    common = ("rollout.max_new_tokens=16", "rl.max_staleness=0", "train.steps=3", f"eval.manifest={fx['train']}",
              "eval.limit=2", "eval.every=1", "eval.max_new_tokens=4")
    one = train(load_config(RLEPConfig, None, _overrides(fx, tmp_path / "one", *common)),
                      answer_length=lengths)
    two = train(load_config(RLEPConfig, None, _overrides(
        fx, tmp_path / "two", *common, "rl.ray.learners=2", "train.strategy=fsdp2", "rl.ray.learner_cpus=0.5")),
        answer_length=lengths)
    assert one["finished"] and two["finished"]
    assert (one["strategy"], one["learner_ranks"], two["strategy"], two["learner_ranks"]) == ("none", 1, "fsdp2", 2)
    assert one["staleness"] == two["staleness"] == {0: 3 * B * G}
    assert one["rewards"] == two["rewards"]
    assert [e["step"] for e in one["eval_curve"]] == [0, 1, 2, 3] and one["eval_curve"] == two["eval_curve"]
    assert two["losses"] == pytest.approx(one["losses"], abs=2e-5)
    a = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert set(a) == set(b)
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst < 2e-5, f"max |2 FSDP2 learner ranks - 1 rank| = {worst:.3g}"
    start = load_file(str(fx["ckpt"] / "model.safetensors"))
    assert any(not torch.equal(a[k], start[k]) for k in a if k in start)  # it trained


def test_prompt_filtering_runs_on_a_ray_task_and_reports_an_empty_question_set(fx, ray_cluster, tmp_path):
    """``data.filter_samples`` in async mode samples the start weights in a one-off Ray task (the driver holds
    no policy); a random policy never answers correctly, so nothing is kept and the run fails with a typed
    error after releasing its learner group."""
    from keye.errors import KeyeConfigError

    cfg = load_config(RLEPConfig, None, _overrides(fx, tmp_path / "f", "data.filter_samples=2",
                                                    "rollout.max_new_tokens=3"))
    with pytest.raises(KeyeConfigError, match="prompt filtering kept no prompt"):
        train(cfg)
    assert not (tmp_path / "f" / "trajectories.jsonl").exists()
    _assert_released()
