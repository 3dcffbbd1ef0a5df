"""Replay pool: dedup, caps, fewer-than-M handling, determinism, state and JSONL round trips, phase A."""

from __future__ import annotations

import json
import random

import pytest
import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.algorithms.replay import ReplayEntry, ReplayPool, replay_samples
from keye.rl.loop.collect import collect
from keye.rl.rollout.samples import PromptInputs, RLPrompt, RolloutSample
from keye.rl.rollout.scoring import Scores

EOS = 99


def _pool(n_per_q=(5, 1), seed=0, **kw) -> ReplayPool:
    pool = ReplayPool(seed=seed, **kw)
    for q, n in enumerate(n_per_q):
        for i in range(n):
            pool.add(ReplayEntry(f"q{q}", f"answer {i}", [10 + i, EOS], 1.0, {"mode": "think"}))
    return pool


def test_dedup_and_caps():
    pool = ReplayPool(max_per_question=2)
    assert pool.add(ReplayEntry("q", "a", [1, EOS]))
    assert not pool.add(ReplayEntry("q", "a again", [1, EOS]))  # same token ids
    assert pool.add(ReplayEntry("q", " b ", None))
    assert not pool.add(ReplayEntry("q", "b", None))  # same stripped text
    assert not pool.add(ReplayEntry("q", "c", None))  # full, drop_new keeps the collected pool
    assert [e.response for e in pool.entries("q")] == ["a", " b "]
    fifo = ReplayPool(max_per_question=2, overflow="drop_oldest")
    for t in "abc":
        fifo.add(ReplayEntry("q", t))
    assert [e.response for e in fifo.entries("q")] == ["b", "c"]
    assert fifo.add(ReplayEntry("q", "a"))  # evicted entries may come back
    with pytest.raises(KeyeConfigError):
        ReplayPool(overflow="random")


def test_sample_without_replacement_and_short_pools():
    pool = _pool((5, 1, 0))
    picks = pool.sample("q0", 3, random.Random(0))
    assert len(picks) == 3 and len({e.response for e in picks}) == 3
    assert [e.response for e in pool.sample("q1", 3)] == ["answer 0"]  # fewer than M: all of them
    assert pool.sample("unknown", 2) == []
    assert pool.sample("q0", 2, mode="no_think") == []  # mode filter
    pool.add(ReplayEntry("q0", "modeless", [1, EOS]))
    assert [e.response for e in pool.sample("q0", 2, mode="no_think")] == ["modeless"]  # serves every mode


def test_replay_rows_mask_missing_slots():
    pool = _pool((5, 1))
    prompt = RLPrompt("q1", [{"role": "user", "content": "x"}], mode="think")
    inputs = PromptInputs(torch.tensor([1, 2, 3]))
    rows = replay_samples(pool, prompt, 4, inputs, 2, encode=lambda s: [7] * len(s), eos_id=EOS,
                          max_response_len=16)
    assert len(rows) == 2 and [r.valid for r in rows] == [True, False]
    assert rows[0].response_ids.tolist() == [10, EOS] and rows[0].source == "replay" and rows[0].group == 4
    assert rows[1].response_ids.numel() == 0 and rows[1].inputs is inputs


def test_text_entries_are_retokenised_with_eos_and_truncated():
    pool = ReplayPool()
    pool.add(ReplayEntry("q", "abcdef", None, metadata={"mode": None}))
    prompt = RLPrompt("q", [])
    enc = lambda s: [ord(c) for c in s]  # noqa: E731 - a stand-in tokenizer
    full = replay_samples(pool, prompt, 0, PromptInputs(torch.tensor([1])), 1, encode=enc, eos_id=EOS,
                          max_response_len=10)[0]
    assert full.response_ids.tolist() == [97, 98, 99, 100, 101, 102, EOS] and full.finished
    cut = replay_samples(pool, prompt, 0, PromptInputs(torch.tensor([1])), 1, encode=enc, eos_id=EOS,
                         max_response_len=4, decode=lambda ids: "".join(map(chr, ids)))[0]
    assert cut.response_ids.tolist() == [97, 98, 99, 100] and not cut.finished and cut.text == "abcd"


def test_determinism_and_state_round_trip():
    a, b = _pool((9,), seed=7), _pool((9,), seed=7)
    draws_a = [[e.response for e in a.sample("q0", 3)] for _ in range(4)]
    assert draws_a == [[e.response for e in b.sample("q0", 3)] for _ in range(4)]
    state = json.loads(json.dumps(a.state_dict()))  # JSON-serialisable
    restored = ReplayPool()
    restored.load_state_dict(state)
    assert [e.response for e in restored.entries("q0")] == [e.response for e in a.entries("q0")]
    assert [[e.response for e in restored.sample("q0", 3)] for _ in range(3)] == \
        [[e.response for e in a.sample("q0", 3)] for _ in range(3)]
    with pytest.raises(KeyeInputError):
        restored.load_state_dict({"entries": []})


def test_jsonl_round_trip_and_errors(tmp_path):
    pool = _pool((3, 2))
    path = pool.save_jsonl(tmp_path / "pool.jsonl")
    back = ReplayPool.load_jsonl(path)
    assert back.questions() == ["q0", "q1"] and len(back) == 5
    assert back.entries("q1")[1].token_ids == [11, EOS]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": "q", "response": "ok"}\n{"question_id": "q", "response": 3}\n')
    with pytest.raises(KeyeInputError, match="line 2"):
        ReplayPool.load_jsonl(bad)
    with pytest.raises(KeyeInputError, match="not found"):
        ReplayPool.load_jsonl(tmp_path / "missing.jsonl")


class _ScriptedEngine:
    """Returns fixed response texts per prompt id (one token per character)."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def generate(self, prompts, n):
        self.calls.append([p.id for p in prompts])
        out = []
        for i, p in enumerate(prompts):
            for j in range(n):
                text = self.script[p.id][j]
                out.append(RolloutSample(p, i, PromptInputs(torch.tensor([1])),
                                         torch.tensor([ord(c) for c in text] + [EOS]), text, True))
        return out


def _right_scorer(samples):
    ok = [s.text.startswith("right") for s in samples]
    return Scores([1.0 if x else -1.0 for x in ok], ok)


def test_collect_keeps_questions_with_two_distinct_successes():
    script = {
        "a": ["right 1", "wrong", "right 2", "wrong"],   # two distinct successes -> kept
        "b": ["right 1", "right 1", "wrong", "wrong"],   # one distinct success -> dropped
        "c": ["wrong"] * 4,                               # none -> dropped
        "d": ["right x", "right y", "right z", "wrong"],  # kept with 3
    }
    prompts = [RLPrompt(q, [], mode="think") for q in script]
    engine = _ScriptedEngine(script)
    pool, stats = collect(engine, prompts, 4, _right_scorer, min_successes=2, batch_prompts=3)
    assert engine.calls == [["a", "b", "c"], ["d"]]
    assert pool.questions() == ["a", "d"] and pool.count("d") == 3
    assert stats.questions == 4 and stats.kept == 2 and stats.candidates == 16 and stats.successes == 7
    assert stats.mean_pass_rate == pytest.approx((2 + 2 + 0 + 3) / 16)
    e = pool.entries("a")[0]
    assert e.token_ids[-1] == EOS and e.metadata == {"mode": "think", "source": "collect"}
    with pytest.raises(KeyeInputError, match="duplicate"):
        collect(engine, [prompts[0], prompts[0]], 4, _right_scorer)


def test_online_growth_adds_only_fresh_successes():
    pool = ReplayPool()
    p = RLPrompt("q", [])
    inp = PromptInputs(torch.tensor([1]))
    fresh_ok = RolloutSample(p, 0, inp, torch.tensor([5, EOS]), "right", True)
    fresh_bad = RolloutSample(p, 0, inp, torch.tensor([6, EOS]), "wrong", True)
    replayed = RolloutSample(p, 0, inp, torch.tensor([7, EOS]), "right 2", True, source="replay")
    added = pool.add_samples([fresh_ok, fresh_bad, replayed, fresh_ok], [True, False, True, True],
                             [1.0, -1.0, 1.0, 1.0], step=3)
    assert added == 1 and pool.entries("q")[0].metadata == {"mode": None, "source": "online", "step": 3}


def test_collect_to_file_from_a_checkpoint_and_manifest(tmp_path):
    from keye.testing.model import save_tiny_checkpoint
    from keye.testing.processor import make_tiny_processor_dir

    policy = save_tiny_checkpoint(tmp_path / "policy")
    make_tiny_processor_dir(policy)
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"id": q, "messages": [{"role": "user", "content": f"question {q}"}],
                                        "answer": "1", "answer_kind": "numeric"}) + "\n" for q in ("a", "b")))

    def every_other(samples):  # a stand-in verifier: alternate samples pass
        ok = [i % 2 == 0 for i in range(len(samples))]
        return Scores([1.0 if x else 0.0 for x in ok], ok)

    from keye.rl.loop.collect import collect_to_file

    stats = collect_to_file(policy, data, tmp_path / "pool.jsonl", n=4, max_new_tokens=4, scorer=every_other,
                            batch_prompts=1)
    pool = ReplayPool.load_jsonl(tmp_path / "pool.jsonl")
    assert stats.questions == 2 and stats.candidates == 8 and stats.successes == 4
    # distinct sampled answers: a question stays when its two passing samples differ
    assert set(pool.questions()) <= {"a", "b"} and len(pool.questions()) == stats.kept
    for q in pool.questions():
        assert all(e.token_ids and e.metadata["source"] == "collect" for e in pool.entries(q))


def test_collect_to_file_accepts_the_embedded_default(tmp_path):
    from keye.rl.loop.collect import collect_to_file

    data = tmp_path / "rl.jsonl"
    data.write_text(json.dumps({"id": "q", "messages": [{"role": "user", "content": "How many shapes? Answer with a number."}],
                                "answer": "1", "answer_kind": "numeric"}) + "\n")
    stats = collect_to_file("keye-tiny", data, tmp_path / "pool.jsonl", n=2, max_new_tokens=2,
                            scorer=lambda s: Scores([1.0] * len(s), [True] * len(s)))
    assert stats.questions == 1 and stats.candidates == 2 and (tmp_path / "pool.jsonl").is_file()


def test_truncated_replay_rows_are_scored_on_the_trained_tokens():
    """A stored success longer than the response limit trains on its first ``max_response_len`` ids, so the
    reward must judge exactly those ids (decoded), not the stored full text: a numeric answer cut in half
    is not a verified success any more, while an entry within the limit keeps its stored text."""
    from keye.rewards import RewardSpec
    from keye.rl.rollout.scoring import RewardScorer

    enc = lambda s: [ord(c) for c in s]  # noqa: E731 - a stand-in tokenizer (one id per character)
    dec = lambda ids: "".join(chr(i) for i in ids if i != EOS)  # noqa: E731 - its inverse (EOS is special)
    prompt = RLPrompt("q", [], reference="123456", task="numeric")
    inputs = PromptInputs(torch.tensor([1]))
    scorer = RewardScorer(RewardSpec.from_dict({"rewards": ["accuracy"]}))
    for entry in (ReplayEntry("q", "123456", None), ReplayEntry("q", "123456", enc("123456") + [EOS])):
        pool = ReplayPool()
        pool.add(entry)
        fits = replay_samples(pool, prompt, 0, inputs, 1, encode=enc, decode=dec, eos_id=EOS, max_response_len=16)[0]
        assert fits.text == "123456" and fits.finished and fits.metadata.get("truncated") is None
        cut = replay_samples(pool, prompt, 0, inputs, 1, encode=enc, decode=dec, eos_id=EOS, max_response_len=3)[0]
        assert cut.response_ids.tolist() == [49, 50, 51] and not cut.finished
        assert cut.text == dec(cut.response_ids.tolist()) == "123" and cut.metadata["truncated"] is True
        scores = scorer([fits, cut])
        assert scores.passed == [True, False] and scores.rewards[0] > scores.rewards[1]
        # without a decoder a truncated row cannot be scored on its tokens: a clear error, not a silent mismatch
        with pytest.raises(KeyeConfigError, match="decode"):
            replay_samples(pool, prompt, 0, inputs, 1, encode=enc, eos_id=EOS, max_response_len=3)
