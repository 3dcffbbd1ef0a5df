"""How the streaming update splits a batch into parts (keye.rl.loop.batcher.StreamingUpdate): a free learner
gets each group at once, a busy one gets the groups that completed meanwhile in one part, and nothing is lost or
sent twice. (That any split gives the barrier update's parameters is tests/train/test_rl_sharded.py.)"""

from __future__ import annotations

from types import SimpleNamespace

from keye.rl.loop.batcher import StreamingUpdate


class FakeLearner:
    def __init__(self, ranks: int = 1, busy: list[bool] | None = None):
        self.ranks, self.parts, self.finished = ranks, [], 0
        if busy is not None:
            self._answers = list(busy)
            self.busy = lambda: self._answers.pop(0) if self._answers else False

    def stream_part(self, samples, **_):
        self.parts.append([s.id for s in samples])

    def finish_stream(self, **_):
        self.finished += 1
        return "result"


def _group(k: int, size: int = 2):
    return [SimpleNamespace(id=f"g{k}s{j}") for j in range(size)]


def _run(learner, n_groups: int, polls_between: int = 0):
    update = StreamingUpdate(learner, pad_id=0, use_tree=False, loss_kwargs={})
    for k in range(n_groups):
        update.add(_group(k))
        for _ in range(polls_between):
            update.poll()
    batch = SimpleNamespace(timing={}, extra={})
    assert update.finish(batch) == "result" and learner.finished == 1
    return batch


def test_an_in_process_learner_gets_every_group_at_once():
    learner = FakeLearner()
    batch = _run(learner, 4)
    assert learner.parts == [["g0s0", "g0s1"], ["g1s0", "g1s1"], ["g2s0", "g2s1"], ["g3s0", "g3s1"]]
    assert batch.extra["stream/parts"] == 4.0


def test_a_busy_learner_gets_the_waiting_groups_in_one_part():
    # free for group 0; busy when groups 1 and 2 arrive; free when group 3 arrives: 1, 2 and 3 go together
    learner = FakeLearner(busy=[False, True, True, False])
    batch = _run(learner, 4)
    assert [len(p) // 2 for p in learner.parts] == [1, 3]
    assert sorted(i for p in learner.parts for i in p) == sorted(f"g{k}s{j}" for k in range(4) for j in range(2))
    assert batch.extra["stream/parts"] == 2.0


def test_poll_sends_as_soon_as_the_learner_frees_up_and_finish_sends_the_rest():
    learner = FakeLearner(busy=[False, True, False, True, True, True])
    _run(learner, 3, polls_between=1)
    # g0 at once; g1 waits (busy), goes at the next poll; g2 waits through its add and poll, goes with finish
    assert learner.parts == [["g0s0", "g0s1"], ["g1s0", "g1s1"], ["g2s0", "g2s1"]]


def test_parts_hold_at_least_one_group_per_rank():
    learner = FakeLearner(ranks=2)
    _run(learner, 5)
    assert [len(p) // 2 for p in learner.parts] == [2, 2, 1]  # the last, short part is sent by finish
