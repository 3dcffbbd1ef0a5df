"""keye.rl.rollout.rollout_manager.RolloutManager with in-process fake workers (keye.testing.rollout): routing by
tokens in flight, streaming into the trajectory manager, pause / weight update / resume with partial
rollouts continuing under the new version, and worker deaths (mid-step and silent) with restart and
requeue. Every answer is a known function of (prompt, sample), so the tests check token by token that
nothing was lost or repeated, and log-prob by log-prob which weight version sampled it."""

from __future__ import annotations

import json

import pytest

from keye.errors import KeyeConfigError
from keye.rl.rollout.rollout_manager import RolloutManager, TokenChunk, WorkerProtocolError
from keye.rl.rollout.trajectory import TrajectoryManager
from keye.testing.rollout import EOS, FakeRolloutWorker, expected_logp, expected_token


def length_of(prompt_id: str, sample: int) -> int:
    """A spread of answer lengths (1..23 tokens) with a long tail."""
    i = int(prompt_id[1:])
    return 1 + (7 * i + 5 * sample) % 9 + (14 if (i + sample) % 5 == 0 else 0)


def make_factory(plans: dict[tuple[int, int], dict] | None = None, tokens_per_poll: int = 2, version: int = 0):
    """``plans[(worker index, incarnation)]``: extra FakeRolloutWorker kwargs (deaths); workers start serving
    ``version``; records every worker built in ``built``."""
    built: list[tuple[int, FakeRolloutWorker]] = []
    incarnations: dict[int, int] = {}

    def factory(i: int) -> FakeRolloutWorker:
        n = incarnations.get(i, 0)
        incarnations[i] = n + 1
        w = FakeRolloutWorker(length_of, tokens_per_poll=tokens_per_poll, version=version, **(plans or {}).get((i, n), {}))
        built.append((i, w))
        return w

    factory.built = built  # type: ignore[attr-defined]
    return factory


def check_exact(traj) -> None:
    """The trajectory holds exactly its answer, each log-prob matching the version recorded for its token."""
    n = length_of(traj.prompt_id, traj.sample)
    assert traj.tokens == [expected_token(traj.prompt_id, traj.sample, p, n) for p in range(n)]
    assert traj.tokens[-1] == EOS
    assert traj.logps == [expected_logp(t, v) for t, v in zip(traj.tokens, traj.versions)]


def score(tm: TrajectoryManager, finished: list[int]) -> None:
    for tid in finished:
        tm.on_scored(tid, 1.0, True)


def run_until_done(rm: RolloutManager, tm: TrajectoryManager, max_steps: int = 500) -> int:
    steps = 0
    while tm.pending() or tm.in_flight():
        score(tm, rm.step())
        steps += 1
        assert steps < max_steps, "the rollout did not finish"
    return steps


def test_requests_go_to_the_worker_with_fewest_tokens_in_flight():
    tm = TrajectoryManager()
    tm.add_prompts(["p0", "p1", "p2", "p3", "p4"], 1, 0,
                   meta=[{"prompt_tokens": n} for n in (100, 1, 1, 1, 1)])
    factory = make_factory()
    rm = RolloutManager(tm, factory, 2, max_inflight=3)
    rm._dispatch()
    w0, w1 = rm.workers
    # p0 (101 tokens of load) -> worker 0; then worker 1 is lighter until it is full (3 requests)
    assert sorted(tm.get(t).prompt_id for t in w0.held) == ["p0", "p4"]
    assert sorted(tm.get(t).prompt_id for t in w1.held) == ["p1", "p2", "p3"]
    assert rm.loads() == [103, 6]
    rm.step()
    # two tokens each: p4's whole answer (2 tokens) finished and left worker 0; generated tokens add load
    assert length_of("p4", 0) == 2
    assert rm.loads() == [101 + 2, 3 * (2 + 2)]


def test_everything_generated_exactly_once_with_scoring_and_consumption():
    tm = TrajectoryManager()
    gids = tm.add_prompts([f"p{i}" for i in range(6)], 3, 0)
    rm = RolloutManager(tm, make_factory(), 3, max_inflight=4)
    run_until_done(rm, tm)
    ready = tm.ready_groups(0, 0)
    assert [g.id for g in ready] == gids
    out = tm.consume(gids)
    for t in out:
        check_exact(t)
        assert set(t.versions) == {0}
    total = sum(length_of(t.prompt_id, t.sample) for t in out)
    assert tm.counts()["generated"] == rm.counts()["tokens"] == total
    assert rm.counts()["finished"] == tm.counts()["finished"] == 18
    assert rm.num_inflight() == 0


def test_weight_update_pauses_and_partial_rollouts_continue_under_the_new_version():
    tm = TrajectoryManager()
    tm.add_prompts([f"p{i}" for i in range(4)], 2, 0)
    factory = make_factory()
    rm = RolloutManager(tm, factory, 2, max_inflight=8)
    score(tm, rm.step())
    score(tm, rm.step())
    assert all(len(tm.get(i).tokens) == 4 for i in tm.in_flight())
    score(tm, rm.update_weights({"w": "v1"}, 1))
    assert all(w.loaded == [1] for w in rm.workers) and not rm.paused
    run_until_done(rm, tm)
    spanning = 0
    for t in tm.consume([g.id for g in tm.ready_groups(1, 1)]):
        check_exact(t)
        if len(t.tokens) > 4:  # started under version 0, continued under version 1 after 4 tokens
            assert t.version_spans() == [(0, 0, 4), (1, 4, len(t.tokens))]
            spanning += 1
        else:
            assert set(t.versions) == {0}
    assert spanning == sum(length_of(f"p{i}", j) > 4 for i in range(4) for j in range(2)) > 0
    with pytest.raises(KeyeConfigError, match="must increase"):
        rm.update_weights({}, 1)


def test_pause_stops_dispatch_and_sampling_until_resume():
    tm = TrajectoryManager()
    tm.add_prompts(["p1", "p2"], 1, 0)
    rm = RolloutManager(tm, make_factory(), 1, max_inflight=1)
    score(tm, rm.step())
    rm.pause()
    before = [list(t.tokens) for t in tm.trajectories()]
    for _ in range(3):
        assert rm.step() == []
    assert [list(t.tokens) for t in tm.trajectories()] == before
    assert tm.pending() == 1  # the second prompt was not dispatched while paused
    rm.resume()
    run_until_done(rm, tm)


@pytest.mark.parametrize("death", ["mid_step", "silent", "submit"])
def test_dead_worker_is_restarted_and_its_trajectories_finish_once_with_nothing_lost(death):
    plans = {"mid_step": {(1, 0): {"die_at_poll": 3}},
             "silent": {(1, 0): {"dead_at_poll": 3}},
             "submit": {}}[death]
    tm = TrajectoryManager(max_new_tokens=40)
    tm.add_prompts([f"p{i}" for i in range(8)], 2, 0)
    factory = make_factory(plans)
    rm = RolloutManager(tm, factory, 3, max_inflight=3)
    if death == "submit":
        def broken_submit(requests):
            raise ConnectionError("actor gone")

        rm.workers[2].submit = broken_submit  # the first dispatch to worker 2 fails
    score(tm, rm.step())
    score(tm, rm.update_weights(b"shards-v1", 1))
    held_by_dying = len(rm.inflight[1]) if death != "submit" else rm.counts()["requeued"]
    assert held_by_dying > 0
    run_until_done(rm, tm)
    c, tc = rm.counts(), tm.counts()
    assert c["worker_deaths"] == c["restarts"] == 1
    assert c["requeued"] == tc["requeued"] == tc["retries"] == held_by_dying
    replacement = [w for i, w in factory.built if i == (1 if death != "submit" else 2)][-1]
    if death != "submit":
        assert replacement.loaded == [1]  # the restarted worker got the latest weights first
    out = tm.consume([g.id for g in tm.ready_groups(1, 1)])
    assert len(out) == 16
    for t in out:
        check_exact(t)  # each token exactly once, in order, across the death
    total = sum(length_of(t.prompt_id, t.sample) for t in out)
    assert tc["generated"] == total and tc["finished"] == 16
    retried = [t for t in out if t.retries]
    assert len(retried) == held_by_dying and all(t.retries == 1 for t in retried)
    for t in retried:
        if death == "submit":  # failed before sampling anything: restarted from scratch under version 1
            assert set(t.versions) == {1}
        else:
            # two tokens sampled under version 0 before the death were kept; the tokens of the dying poll
            # were lost and sampled again by another worker under version 1
            assert t.version_spans()[0] == (0, 0, 2) and set(t.versions[2:]) == {1}


def test_a_chunk_from_another_version_is_a_protocol_error():
    tm = TrajectoryManager()
    tm.add_prompts(["p1"], 1, 0)
    rm = RolloutManager(tm, make_factory(), 1)
    rm.step()
    (tid,) = tm.in_flight()
    rm.workers[0].poll = lambda: [TokenChunk(tid, 1, (5,), (-1.0,), 3)]
    with pytest.raises(WorkerProtocolError, match="version 3 .* serving version 0"):
        rm.step()


def test_async_loop_with_staleness_bound_worker_death_and_driver_restart():
    """A whole asynchronous run: admission bound with max_staleness 1, a batch of B groups trains each
    update (consumed in admission order), weights are synced while answers are in flight, a worker dies,
    and half way the driver is killed and resumed from the JSON state of the trajectory manager with new
    workers. Every consumed answer is exact, no consumed trajectory is staler than the bound, some answers
    span two versions, and no group is consumed twice."""
    B, G, k, updates = 2, 2, 1, 8
    tm = TrajectoryManager(max_new_tokens=40)
    rm = RolloutManager(tm, make_factory({(0, 0): {"die_at_poll": 9}}, tokens_per_poll=1), 2, max_inflight=3)
    version, consumed, prompts = 0, [], 0
    for _ in range(400):
        n = tm.admissible_groups(version, k, B)
        tm.add_prompts([f"p{prompts + i}" for i in range(n)], G, version)
        prompts += n
        score(tm, rm.step())
        ready = tm.ready_groups(version, k, limit=B)
        if len(ready) == B:
            for t in tm.consume([g.id for g in ready]):
                consumed.append((t, version))
            version += 1
            if version == updates // 2:  # the driver dies here; a new one resumes from the checkpoint
                state = json.dumps(tm.state_dict())
                tm = TrajectoryManager.from_state_dict(json.loads(state))
                n = len(tm.in_flight())
                assert tm.reclaim() == n > 0
                # new workers load the checkpoint's weights (version - 1); the sync below brings them up
                rm = RolloutManager(tm, make_factory(tokens_per_poll=1, version=version - 1), 2, max_inflight=3,
                                    version=version - 1)
            score(tm, rm.update_weights({"v": version}, version))
            if version == updates:
                break
    assert version == updates
    assert len(consumed) == updates * B * G
    assert len({(t.group, t.sample) for t, _ in consumed}) == len(consumed)
    assert sorted({t.group for t, _ in consumed}) == list(range(updates * B))
    for t, at in consumed:
        check_exact(t)
        assert min(t.versions) >= at - k
    assert any(len(set(t.versions)) > 1 for t, _ in consumed)
    assert tm.counts()["dropped_stale"] == 0
    assert tm.counts()["reclaimed"] > 0 and tm.counts()["requeued"] > 0
