"""``keye train rlep`` with ``algorithm.autothink``: config checks, a short real run on a tiny checkpoint (linked
groups expanded and recorded, auto rewards = the reward function on the recorded groups, metrics, replay and
dynamic sampling through the linked groups, forced groups trained or not), and exact kill-and-resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from keye.errors import KeyeConfigError
from keye.recipes.rlep import train
from keye.rl.algorithms.autothink import (
    ROLES,
    GroupLog,
    decision_of,
    mode_selection_rewards,
    read_records,
    replies_of,
)
from keye.rl.config import RLEPConfig, validate
from keye.train.config import load_config
from tests.recipes import AT_DIRECT_N, AT_G, AT_M, AT_MAX_NEW, AT_THINK_N, at_config

REPO = Path(__file__).resolve().parents[2]
G, THINK_N, DIRECT_N, M, MAX_NEW = AT_G, AT_THINK_N, AT_DIRECT_N, AT_M, AT_MAX_NEW


def test_autothink_config_checks():
    base = ["algorithm.autothink.enabled=true"]
    cfg = load_config(RLEPConfig, REPO / "training/configs/tiny_synth_rlep.yaml", base)
    validate(cfg)
    assert cfg.algorithm.autothink.margin == 0.05 and not RLEPConfig().algorithm.autothink.enabled
    validate(load_config(RLEPConfig, REPO / "training/configs/tiny_synth_rlep.yaml", base + ["rl.engine=ray"]))
    for extra, msg in ((["rl.engine=ray", "rl.mode=async"], "rl.mode=async"),
                       (["algorithm.mode_mix={think: 1, auto: 1}"], "mode_mix"),
                       (["algorithm.autothink.length_penalty=1.0"], "accuracy gap"),
                       (["algorithm.autothink.margin=-0.1"], "algorithm.autothink.margin")):
        with pytest.raises(KeyeConfigError, match=msg):
            validate(load_config(RLEPConfig, REPO / "training/configs/tiny_synth_rlep.yaml", base + extra))
    # with the {-1, +1} verifier the gap is 2: a penalty of 1.0 is allowed
    validate(load_config(RLEPConfig, REPO / "training/configs/tiny_synth_rlep.yaml",
                         base + ["algorithm.autothink.length_penalty=1.0", "reward.spec={rewards: [accuracy], "
                                 "options: {accuracy_pm1: true}}"]))


def test_short_autothink_run_links_records_and_rewards_groups(tiny_ckpt, at_set, tmp_path):
    cfg = at_config(tiny_ckpt, at_set, tmp_path / "run", "train.steps=2", "algorithm.dynamic_sampling=true",
               "algorithm.mini_batches=2", "reward.spec={rewards: [accuracy, format]}")
    summary = train(cfg)
    run = tmp_path / "run"
    assert summary["finished"] and summary["tree"]
    records = read_records(run / GroupLog.NAME)
    assert [r["step"] for r in records] == [1, 1, 2, 2]
    ids = {json.loads(x)["id"] for x in at_set["train"].read_text().splitlines()}
    modes = {"auto": "auto", "think": "think", "direct": "no_think"}
    sizes = {"auto": G + M, "think": THINK_N + M, "direct": DIRECT_N + M}
    at = cfg.algorithm.autothink
    n_bonus = n_penalty = 0
    for row in records:
        assert row["question"] in ids and set(row["groups"]) == set(ROLES)
        for role in ROLES:
            replies = row["groups"][role]
            assert len(replies) == sizes[role], (role, len(replies))
            assert [x["source"] for x in replies] == ["rollout"] * (sizes[role] - M) + ["replay"] * M
            assert all(x["mode"] == modes[role] and x["valid"] for x in replies)
        for role in ("think", "direct"):  # forced replies keep their ordinary reward
            assert all(x["reward"] == x["base_reward"] for x in row["groups"][role])
        # the auto rewards are the reward function applied to the recorded linked groups (length scale
        # = rollout.max_new_tokens since algorithm.autothink.length_scale is null)
        res = mode_selection_rewards(*(replies_of(row, role) for role in ROLES), at, length_scale=MAX_NEW)
        assert [x["reward"] for x in row["groups"]["auto"]] == pytest.approx([a.reward for a in res.auto], abs=0)
        assert (row["p_think"], row["p_direct"], row["prefer"]) == (res.p_think, res.p_direct, res.prefer)
        assert res.n_think >= THINK_N and res.n_direct >= DIRECT_N  # fresh auto replies may join either
        n_bonus += sum(a.bonus > 0 for a in res.auto)
        n_penalty += sum(a.length_penalty > 0 for a in res.auto)
    # a random model fails almost everything, so direct is preferred (0 >= 0 - margin): the replayed
    # well-formed direct reply gets the bonus, the replayed thinking one the length penalty
    assert n_bonus > 0 and n_penalty > 0
    metric_rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metric_rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r, step in zip(steps, (1, 2)):
        for key in ("autothink/think_rate", "autothink/p_think", "autothink/p_direct", "autothink/auto_accuracy",
                    "autothink/mean_reply_tokens", "autothink/prefer_direct", "autothink/format_ok"):
            assert key in r, key
        rows = [x for x in records if x["step"] == step]
        fresh_auto = [x for row in rows for x in row["groups"]["auto"] if x["source"] == "rollout"]
        assert r["autothink/mean_reply_tokens"] == pytest.approx(sum(x["tokens"] for x in fresh_auto) / len(fresh_auto))
        assert r["autothink/auto_accuracy"] == pytest.approx(sum(x["passed"] for x in fresh_auto) / len(fresh_auto))
        assert r["autothink/p_think"] == pytest.approx(sum(row["p_think"] for row in rows) / len(rows))
        # the forced groups are trained: M replayed rows in each of the 3 linked groups of every question
        assert r["replay_share"] == pytest.approx(3 * M / (G + THINK_N + DIRECT_N + 3 * M))
        assert r["dynsample/kept_frac"] == 1.0  # replayed successes make every auto group informative


def test_forced_groups_can_stay_out_of_the_update(tiny_ckpt, at_set, tmp_path):
    cfg = at_config(tiny_ckpt, at_set, tmp_path / "run", "train.steps=1", "algorithm.autothink.train_forced=false",
               "algorithm.autothink.record=false")
    train(cfg)
    assert not (tmp_path / "run" / GroupLog.NAME).exists()
    row = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines() if '"loss"' in x][0]
    assert row["replay_share"] == pytest.approx(M / (G + M))  # only the auto groups are trained
    assert "autothink/p_direct" in row  # the forced groups were still sampled for the estimates


def test_explored_decisions_are_forced_trained_and_counted_apart(tiny_ckpt, at_set, tmp_path):
    cfg = at_config(tiny_ckpt, at_set, tmp_path / "run", "train.steps=1", "rollout.G=4", "algorithm.autothink.explore=2",
               "algorithm.autothink.think_prefix=<think>", "algorithm.autothink.direct_prefix='Answer:'")
    train(cfg)
    records = read_records(tmp_path / "run" / GroupLog.NAME)
    for row in records:
        fresh = [x for x in row["groups"]["auto"] if x["source"] == "rollout"]
        assert [x["forced"] for x in fresh] == [None, None, "think", "direct"]
        assert fresh[-2]["text"].startswith("<think>") and fresh[-1]["text"].startswith("Answer:")
        assert all(x["forced"] is None for role in ("think", "direct") for x in row["groups"][role])
    row = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines() if '"loss"' in x][0]
    free = [x for r in records for x in r["groups"]["auto"] if x["source"] == "rollout" and x["forced"] is None]
    thinks = [decision_of(x["text"]) == "think" for x in free]
    assert row["autothink/free_think_rate"] == pytest.approx(sum(thinks) / len(thinks))
    with pytest.raises(KeyeConfigError, match="explore"):
        validate(at_config(tiny_ckpt, at_set, tmp_path / "bad", f"algorithm.autothink.explore={2 * G}"))


@pytest.mark.slow
def test_autothink_kill_and_resume_equals_uninterrupted(tiny_ckpt, at_set, tmp_path):
    # pass_value=0: every fresh answer "passes", so the pool grows online and the resumed run must restore it
    args = ("train.steps=3", "checkpoint.save_every=1", "checkpoint.keep_last=2", "reward.pass_value=0.0")
    full = train(at_config(tiny_ckpt, at_set, tmp_path / "a", *args))
    part = train(at_config(tiny_ckpt, at_set, tmp_path / "b", *args), stop_after=2)  # "crash" after step 2...
    assert not part["finished"]
    shutil.rmtree(tmp_path / "b" / "step_00000002")  # ...whose checkpoint is lost: step 2 is redone from step 1
    assert max(r["step"] for r in read_records(tmp_path / "b" / GroupLog.NAME)) == 2
    resumed = train(at_config(tiny_ckpt, at_set, tmp_path / "b", *args))
    assert resumed["finished"] and resumed["rewards"] == full["rewards"] and resumed["losses"] == full["losses"]
    # the group log of the resumed run forgot the redone step's rows: it equals the uninterrupted run's
    assert read_records(tmp_path / "b" / GroupLog.NAME) == read_records(tmp_path / "a" / GroupLog.NAME)
