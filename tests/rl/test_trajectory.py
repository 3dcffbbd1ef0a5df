"""keye.rl.rollout.trajectory.TrajectoryManager: states, per-token versions and behaviour log-probs, staleness,
requeues after worker failures, sync mode, and exact resume from a JSON state.

The property tests drive the manager with random event sequences (hypothesis) through a small driver that
plays workers, a scorer and a trainer, and check after every event: per-token lists of equal length,
versions non-decreasing, the staleness bound on every consumed trajectory (recomputed from its per-token
version record), no trajectory or group slot consumed twice, and the trajectory count balance.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.rollout.trajectory import TrajectoryManager


def _gen(tm: TrajectoryManager, tid: int, n: int, version: int) -> None:
    t = tm.get(tid)
    start = t.num_tokens
    tm.on_tokens(tid, t.attempt, [10 + start + i for i in range(n)], [-0.1 * (start + i) for i in range(n)], version)


def test_lifecycle_records_versions_logps_and_counts():
    tm = TrajectoryManager(max_new_tokens=8)
    (gid,) = tm.add_prompts(["q0"], 2, version=3)
    reqs = tm.next_requests(5)
    assert [(r.group, r.sample, r.tokens, r.max_new_tokens, r.attempt) for r in reqs] == [
        (gid, 0, (), 8, 1), (gid, 1, (), 8, 1)]
    a, b = (r.traj_id for r in reqs)
    tm.on_tokens(a, 1, [5, 6], [-0.5, -0.25], 3)
    tm.on_tokens(a, 1, [7], [-1.0], 4)  # continued after a weight update
    tm.on_tokens(b, 1, [8], [-2.0], 4)
    assert tm.on_finished(a, 1, "stop") and tm.on_finished(b, 1, "length")
    ta = tm.get(a)
    assert ta.tokens == [5, 6, 7] and ta.logps == [-0.5, -0.25, -1.0] and ta.versions == [3, 3, 4]
    assert ta.start_version == 3 and tm.get(b).start_version == 4
    assert ta.version_spans() == [(3, 0, 2), (4, 2, 3)]
    assert tm.ready_groups(4, 1) == []  # not scored yet
    tm.on_scored(a, 1.0, True)
    tm.on_scored(b, 0.0, False)
    (ready,) = tm.ready_groups(4, 1)
    assert ready.id == gid and ready.rewards == [1.0, 0.0] and ready.admitted_version == 3
    out = tm.consume([gid])
    assert [t.id for t in out] == [a, b] and all(t.state == "consumed" for t in out)
    assert tm.trajectories() == []
    c = tm.counts()
    assert (c["added"], c["dispatched"], c["chunks"], c["generated"], c["finished"], c["scored"], c["consumed"],
            c["groups_consumed"]) == (2, 2, 3, 4, 2, 2, 2, 1)


def test_bad_events_raise_clear_errors():
    tm = TrajectoryManager(max_new_tokens=3)
    tm.add_prompts(["q"], 1, 0)
    (r,) = tm.next_requests(1)
    with pytest.raises(KeyeInputError, match="as many log-probs"):
        tm.on_tokens(r.traj_id, 1, [1, 2], [-1.0], 0)
    with pytest.raises(KeyeInputError, match="as many log-probs"):
        tm.on_tokens(r.traj_id, 1, [], [], 0)
    tm.on_tokens(r.traj_id, 1, [1], [-1.0], 2)
    with pytest.raises(KeyeInputError, match="version 1 after tokens of version 2"):
        tm.on_tokens(r.traj_id, 1, [1], [-1.0], 1)
    with pytest.raises(KeyeInputError, match="exceed max_new_tokens=3"):
        tm.on_tokens(r.traj_id, 1, [1, 2, 3], [-1.0] * 3, 2)
    with pytest.raises(KeyeInputError, match="never created"):
        tm.on_tokens(99, 1, [1], [-1.0], 2)
    with pytest.raises(KeyeInputError, match="finish reason"):
        tm.on_finished(r.traj_id, 1, "eos")
    with pytest.raises(KeyeInputError, match="only a finished trajectory"):
        tm.on_scored(r.traj_id, 1.0)
    tm.on_finished(r.traj_id, 1)
    with pytest.raises(KeyeInputError, match="not finite"):
        tm.on_scored(r.traj_id, float("nan"))
    with pytest.raises(KeyeInputError, match="not complete"):
        tm.consume([0])
    with pytest.raises(KeyeInputError, match="not live"):
        tm.consume([7])
    with pytest.raises(KeyeConfigError):
        tm.add_prompts(["x"], 0, 0)
    with pytest.raises(KeyeInputError, match="string id"):
        tm.add_prompts([3], 1, 0)
    tm2 = TrajectoryManager()
    tm2.add_prompts(["q"], 1, 0)
    (r2,) = tm2.next_requests(1)
    with pytest.raises(KeyeInputError, match="without any token"):
        tm2.on_finished(r2.traj_id, 1)


def test_requeue_keeps_tokens_ignores_the_dead_workers_late_events_and_counts_one_retry():
    tm = TrajectoryManager(max_new_tokens=6)
    tm.add_prompts(["q"], 2, 0)
    a, b = (r.traj_id for r in tm.next_requests(2))
    tm.on_tokens(a, 1, [4, 5], [-1.0, -2.0], 0)
    assert tm.requeue([(a, 1), (b, 1), (b, 1)]) == 2  # the repeated pair is not requeued twice
    assert tm.get(a).state == "partial" and tm.get(b).state == "queued"
    assert tm.requeue([a]) == 0  # no longer in flight: nothing counted twice
    reqs = tm.next_requests(2)
    assert [(r.traj_id, r.attempt, r.tokens, r.max_new_tokens) for r in reqs] == [(a, 2, (4, 5), 4), (b, 2, (), 6)]
    # the dead worker's chunk and finish (attempt 1) arrive late: ignored
    assert not tm.on_tokens(a, 1, [6], [-3.0], 0)
    assert not tm.on_finished(a, 1)
    assert tm.get(a).tokens == [4, 5] and tm.get(a).state == "generating"
    assert tm.requeue([(a, 1)]) == 0  # the old attempt's worker is restarted again: a, now elsewhere, stays
    assert tm.get(a).state == "generating"
    tm.on_tokens(a, 2, [6], [-3.0], 1)
    assert tm.get(a).versions == [0, 0, 1] and tm.get(a).retries == 1
    c = tm.counts()
    assert (c["requeued"], c["retries"], c["partial_resumed"], c["late_events"]) == (2, 2, 1, 2)


def test_a_trajectory_beyond_max_retries_fails_its_group():
    tm = TrajectoryManager(max_retries=1)
    g0, g1 = tm.add_prompts(["bad", "good"], 2, 0)
    for _ in range(2):
        reqs = tm.next_requests(1)
        assert reqs[0].group == g0 and reqs[0].sample == 0
        tm.requeue([reqs[0].traj_id])
    assert [t.group for t in tm.trajectories()] == [g1, g1]
    c = tm.counts()
    assert (c["groups_failed"], c["dropped_failed"], c["retries"]) == (1, 2, 2)
    assert [r.group for r in tm.next_requests(5)] == [g1, g1]
    assert not tm.on_scored(0, 1.0)  # a trajectory of the failed group: late, ignored


def test_stale_trajectories_are_dropped_and_their_slots_requeued_fresh():
    tm = TrajectoryManager()
    (gid,) = tm.add_prompts(["q"], 2, 0)
    a, b = (r.traj_id for r in tm.next_requests(2))
    _gen(tm, a, 2, 0)
    _gen(tm, b, 1, 1)
    for t in (a, b):
        tm.on_finished(t, 1)
        tm.on_scored(t, 1.0)
    assert [g.id for g in tm.ready_groups(1, 1)] == [gid]  # 0 >= 1 - 1: still fresh
    assert tm.ready_groups(2, 1) == []  # a started at 0 < 2 - 1
    group = tm.group(gid)
    assert group.members[1] == b and group.members[0] not in (a, b)
    fresh = tm.get(group.members[0])
    assert (fresh.state, fresh.sample, fresh.tokens, fresh.start_version) == ("queued", 0, [], None)
    assert tm.counts()["dropped_stale"] == 1
    assert not tm.on_scored(a, 0.0)  # the dropped one's late score is ignored
    (r,) = tm.next_requests(3)
    assert r.traj_id == fresh.id


def test_ready_groups_in_admission_order_or_any_order():
    tm = TrajectoryManager()
    g = tm.add_prompts(["a", "b", "c"], 1, 0)
    reqs = tm.next_requests(3)
    for r in reqs[1:]:
        _gen(tm, r.traj_id, 1, 0)
        tm.on_finished(r.traj_id, 1)
        tm.on_scored(r.traj_id, 0.5)
    assert tm.ready_groups(0, 0) == []
    assert [x.id for x in tm.ready_groups(0, 0, in_order=False)] == g[1:]
    assert [x.id for x in tm.ready_groups(0, 0, in_order=False, limit=1)] == g[1:2]


def test_admissible_groups_bound():
    tm = TrajectoryManager()
    assert tm.admissible_groups(0, 1, 2) == 4
    tm.add_prompts(list("abc"), 1, 0)
    assert tm.admissible_groups(0, 1, 2) == 1
    assert tm.admissible_groups(1, 1, 2) == 3
    assert tm.admissible_groups(0, 0, 2) == 0
    with pytest.raises(KeyeConfigError):
        tm.admissible_groups(0, -1, 2)


def test_reclaim_after_a_driver_restart_is_not_a_retry():
    tm = TrajectoryManager()
    tm.add_prompts(["q"], 2, 0)
    a, b = (r.traj_id for r in tm.next_requests(2))
    _gen(tm, a, 2, 0)
    restored = TrajectoryManager.from_state_dict(json.loads(json.dumps(tm.state_dict())))
    assert restored.in_flight() == [a, b]
    assert restored.reclaim() == 2
    assert [t.state for t in restored.trajectories()] == ["partial", "queued"]
    assert restored.counts()["retries"] == 0 and restored.counts()["reclaimed"] == 2
    assert [r.tokens for r in restored.next_requests(2)] == [(10, 11), ()]


def test_load_state_dict_rejects_a_bad_state():
    tm = TrajectoryManager()
    tm.add_prompts(["q"], 1, 0)
    state = json.loads(json.dumps(tm.state_dict()))
    with pytest.raises(KeyeInputError, match="format"):
        TrajectoryManager.from_state_dict({**state, "format": 99})
    bad = json.loads(json.dumps(state))
    bad["trajectories"][0]["state"] = "flying"
    with pytest.raises(KeyeInputError, match="unknown state"):
        TrajectoryManager.from_state_dict(bad)
    bad = json.loads(json.dumps(state))
    bad["groups"][0]["members"] = [5]
    with pytest.raises(KeyeInputError, match="unknown trajectories"):
        TrajectoryManager.from_state_dict(bad)


# ------------------------------------------------------------------------------ random event sequences
class Driver:
    """Plays workers, scorer and trainer from a list of ``(action, parameter)`` pairs.

    Every choice is a function of the manager's state and the parameter, so two managers in the same state
    fed the same remaining actions must end in the same state. ``admission``: admit groups only within
    :meth:`TrajectoryManager.admissible_groups` and train on exactly ``batch`` groups in admission order.
    """

    def __init__(self, tm: TrajectoryManager, *, group_size: int, batch: int, max_staleness: int,
                 admission: bool):
        self.tm, self.G, self.B, self.k, self.admission = tm, group_size, batch, max_staleness, admission
        self.version = 0
        self.prompts = 0
        self.consumed: list[tuple[int, int, int, tuple[int, ...]]] = []  # (traj id, group, sample, versions)
        self.consumed_at: list[int] = []  # the version each consumed trajectory trained

    # action codes -> events, weighted so that long runs reach consumption (worker deaths are rarer)
    KINDS = ("add", "add", "dispatch", "dispatch", "dispatch", "chunk", "chunk", "chunk", "chunk", "chunk",
             "finish", "finish", "score", "score", "interrupt", "death", "late", "train", "train", "bump")

    def act(self, action: int, p: int) -> None:
        tm = self.tm
        kind = self.KINDS[action % len(self.KINDS)]
        flying = tm.in_flight()
        if kind == "add":
            n = tm.admissible_groups(self.version, self.k, self.B) if self.admission else p % 3
            tm.add_prompts([f"p{self.prompts + i}" for i in range(n)], self.G, self.version)
            self.prompts += n
        elif kind == "dispatch":
            tm.next_requests(p % 4 + 1)
        elif kind == "chunk" and flying:
            t = tm.get(flying[p % len(flying)])
            budget = (tm.max_new_tokens or 10**9) - t.num_tokens
            n = min(1 + p % 3, budget)
            if n > 0:
                tm.on_tokens(t.id, t.attempt, [t.num_tokens + i for i in range(n)],
                             [-(t.num_tokens + i) / 7 for i in range(n)], self.version)
        elif kind == "finish" and flying:
            t = tm.get(flying[p % len(flying)])
            if t.tokens:
                tm.on_finished(t.id, t.attempt, "stop")
        elif kind == "score":
            done = [t.id for t in tm.trajectories() if t.state == "finished"]
            if done:
                tm.on_scored(done[p % len(done)], float(p % 2), bool(p % 2))
        elif kind == "interrupt" and flying:
            t = tm.get(flying[p % len(flying)])
            tm.interrupt(t.id, t.attempt)
        elif kind == "death" and flying:  # a worker dies holding every other in-flight trajectory
            tm.requeue([(i, tm.get(i).attempt) for i in flying[p % 2 :: 2]])
        elif kind == "late" and flying:  # a late chunk from an earlier attempt
            t = tm.get(flying[p % len(flying)])
            if t.attempt > 1:
                before = list(t.tokens)
                assert not tm.on_tokens(t.id, t.attempt - 1, [0], [0.0], self.version)
                assert t.tokens == before
        elif kind == "train":
            self.train(p)
        elif kind == "bump" and not self.admission:
            self.version += 1  # a weight update without a batch (the admission bound assumes one per update)

    def train(self, p: int) -> None:
        ready = self.tm.ready_groups(self.version, self.k, in_order=self.admission)
        take = ready[: self.B] if self.admission else ready[: p % (self.B + 1)]
        if self.admission and len(take) < self.B:
            return
        for t in self.tm.consume([g.id for g in take]):
            self.consumed.append((t.id, t.group, t.sample, tuple(t.versions)))
            self.consumed_at.append(self.version)
        if take:
            self.version += 1

    def check(self) -> None:
        tm = self.tm
        for t in tm.trajectories():
            assert len(t.tokens) == len(t.logps) == len(t.versions)
            assert list(t.versions) == sorted(t.versions)
            assert t.start_version == (t.versions[0] if t.versions else None)
            assert t.state in ("queued", "generating", "partial", "finished", "scored")
            if t.state == "queued":
                assert not t.tokens
            if t.state == "partial":
                assert t.tokens
            if tm.max_new_tokens is not None:
                assert t.num_tokens <= tm.max_new_tokens
        for (_, _, _, versions), at in zip(self.consumed, self.consumed_at):
            assert min(versions) >= at - self.k, "a consumed trajectory exceeded the staleness bound"
        assert len({c[0] for c in self.consumed}) == len(self.consumed)
        assert len({(c[1], c[2]) for c in self.consumed}) == len(self.consumed)
        c = tm.counts()
        live = len(tm.trajectories())
        assert c["added"] == live + c["consumed"] + c["dropped_stale"] + c["dropped_failed"]
        assert c["consumed"] == len(self.consumed)
        assert tm.pending() == sum(t.state in ("queued", "partial") for t in tm.trajectories())


ACTIONS = st.lists(st.tuples(st.integers(0, 19), st.integers(0, 10_000)), min_size=100, max_size=300)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, k=st.integers(0, 2), G=st.integers(1, 3), admission=st.booleans())
def test_property_staleness_never_exceeded_and_nothing_counted_twice(actions, k, G, admission):
    tm = TrajectoryManager(max_new_tokens=5, max_retries=2)
    d = Driver(tm, group_size=G, batch=2, max_staleness=k, admission=admission)
    for a, p in actions:
        d.act(a, p)
        d.check()
    if admission:
        # admission control + in-order consumption of one batch per update never needs a stale drop (a
        # failed group only moves later groups to an earlier, fresher update)
        assert tm.counts()["dropped_stale"] == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=ACTIONS, cut=st.integers(0, 300), k=st.integers(0, 2), admission=st.booleans())
def test_property_state_dict_round_trip_mid_run_gives_the_same_continuation(actions, cut, k, admission):
    def driver(tm):
        return Driver(tm, group_size=2, batch=2, max_staleness=k, admission=admission)

    a = driver(TrajectoryManager(max_new_tokens=5, max_retries=2))
    for act in actions[:cut]:
        a.act(*act)
    snapshot = json.dumps(a.tm.state_dict())
    b = driver(TrajectoryManager.from_state_dict(json.loads(snapshot)))
    b.version, b.prompts = a.version, a.prompts
    assert json.dumps(b.tm.state_dict()) == snapshot
    for act in actions[cut:]:
        a.act(*act)
        b.act(*act)
    assert b.tm.state_dict() == a.tm.state_dict()
    assert b.consumed == a.consumed[len(a.consumed) - len(b.consumed):]
    assert [r.traj_id for r in b.tm.next_requests(50)] == [r.traj_id for r in a.tm.next_requests(50)]


def test_sync_mode_consumes_exactly_the_groups_of_one_version():
    """Synchronous RL: max_staleness 0, admission of one batch per version, no generation while training:
    every consumed token was sampled by the version being trained, and each update takes exactly the batch
    admitted at that version."""
    tm = TrajectoryManager(max_new_tokens=4)
    B, G = 3, 2
    for version in range(4):
        n = tm.admissible_groups(version, 0, B)
        assert n == B
        gids = tm.add_prompts([f"v{version}p{i}" for i in range(n)], G, version)
        while tm.pending() or tm.in_flight():
            for r in tm.next_requests(2):  # fewer requests than samples: several rounds
                _gen(tm, r.traj_id, 1 + (r.traj_id % 3), version)
                tm.on_finished(r.traj_id, r.attempt, "stop")
                tm.on_scored(r.traj_id, float(r.sample))
        assert tm.admissible_groups(version, 0, B) == 0  # nothing more may start before the update
        ready = tm.ready_groups(version, 0)
        assert [g.id for g in ready] == gids
        assert all(g.admitted_version == version for g in ready)
        out = tm.consume(gids)
        assert len(out) == B * G
        assert {v for t in out for v in t.versions} == {version}
    assert tm.counts()["dropped_stale"] == 0
