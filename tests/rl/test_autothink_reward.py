"""AutoThink mode-selection reward on constructed groups (keye/rl/algorithms/autothink.py): easy, hard and mixed questions,
the margin, correctness dominance, format penalty, degenerate groups, and the loop helpers on constructed samples.
Every expected reward is worked out by hand from the formula in docs/autothink.md."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rl.algorithms.autothink import (
    AutoThinkConfig,
    Reply,
    break_even_edge,
    expected_decision_gap,
    finish_metrics,
    flatten,
    group_id,
    group_signal,
    link_groups,
    metric_sums,
    mode_selection_rewards,
    question_records,
    replies_of,
)
from keye.rl.rollout.samples import PromptInputs, RLPrompt, RolloutSample

# auto replies: well-formed direct / think, and malformed ones
DIRECT = "<analysis>Simple lookup. /no_think</analysis>7"
THINK = "<analysis>Needs counting. /think</analysis><think>one two three</think>7"
NO_ANALYSIS = "7"
THINK_NO_ANALYSIS = "<think>one two three</think>7"
INCONSISTENT = "<analysis>I will reason. /think</analysis>7"  # says /think, answers directly
FORCED_THINK = "<think>one two three</think>7"
FORCED_DIRECT = "7"

# budget 4 tokens, full penalty 20 tokens over the budget: penalty = 0.5 * min(1, (tokens - 4) / 20)
CFG = AutoThinkConfig(enabled=True, margin=0.05, mode_bonus=0.5, length_penalty=0.5, length_budget=4,
                      length_scale=20, format_penalty=0.5, include_auto=False)


def forced(text: str, passes: int, fails: int, tokens: int = 5) -> list[Reply]:
    return [Reply(text, tokens, True, 1.0) for _ in range(passes)] + [Reply(text, tokens, False, 0.0)
                                                                      for _ in range(fails)]


def auto(text: str, passed: bool, tokens: int = 6, base: float | None = None, **kw) -> Reply:
    return Reply(text, tokens, passed, (1.0 if passed else 0.0) if base is None else base, **kw)


def rewards(res) -> list[float]:
    return [a.reward for a in res.auto]


# ----------------------------------------------------------------------------------------- easy / hard
def test_easy_question_prefers_direct_and_penalises_long_thinking():
    replies = [auto(DIRECT, True, 3), auto(THINK, True, 10), auto(THINK, True, 14), auto(THINK, True, 30),
               auto(DIRECT, False, 3)]
    res = mode_selection_rewards(replies, forced(FORCED_THINK, 4, 0), forced(FORCED_DIRECT, 4, 0), CFG)
    assert (res.p_think, res.p_direct, res.n_think, res.n_direct, res.prefer) == (1.0, 1.0, 4, 4, "direct")
    # direct correct: 1 + 0.5 bonus; thinking: 1 - 0.5*(10-4)/20 = 0.85, 1 - 0.5*10/20 = 0.75, 1 - 0.5 (capped);
    # a wrong direct reply gets neither bonus nor penalty
    assert rewards(res) == pytest.approx([1.5, 0.85, 0.75, 0.5, 0.0])
    assert [a.decision for a in res.auto] == ["direct", "think", "think", "think", "direct"]
    assert [a.length_penalty for a in res.auto] == pytest.approx([0.0, 0.15, 0.25, 0.5, 0.0])
    assert all(a.well_formed for a in res.auto)
    # the direct reply beats every thinking reply, and longer thinking is worth strictly less
    assert rewards(res)[0] > max(rewards(res)[1:4]) and rewards(res)[1] > rewards(res)[2] > rewards(res)[3]


def test_thinking_within_the_budget_costs_nothing_beyond_losing_the_bonus():
    res = mode_selection_rewards([auto(THINK, True, 4), auto(THINK, True, 2)], forced(FORCED_THINK, 2, 0),
                                 forced(FORCED_DIRECT, 2, 0), CFG)
    assert rewards(res) == [1.0, 1.0]


def test_hard_question_prefers_thinking():
    replies = [auto(THINK, True, 30), auto(THINK, False, 30), auto(DIRECT, False, 3), auto(DIRECT, True, 3)]
    res = mode_selection_rewards(replies, forced(FORCED_THINK, 3, 1), forced(FORCED_DIRECT, 0, 4), CFG)
    assert (res.p_think, res.p_direct, res.prefer) == (0.75, 0.0, "think")
    # thinking correct: 1 + 0.5, no length penalty on a hard question; wrong thinking: 0; wrong direct: 0;
    # a lucky direct answer keeps its accuracy but gets no bonus
    assert rewards(res) == pytest.approx([1.5, 0.0, 0.0, 1.0])


def test_base_reward_is_kept_and_shifted():
    """The mode terms are added to the ordinary reward (here a spec with format + accuracy: 2.0 / 1.0)."""
    res = mode_selection_rewards([auto(DIRECT, True, 3, base=2.0), auto(THINK, True, 24, base=2.0),
                                  auto(DIRECT, False, 3, base=1.0)],
                                 forced(FORCED_THINK, 1, 0), forced(FORCED_DIRECT, 1, 0), CFG)
    assert rewards(res) == pytest.approx([2.5, 2.0 - 0.5 * 20 / 20, 1.0])


# ------------------------------------------------------------------------------------------------ margin
@pytest.mark.parametrize("think_pass, direct_pass, margin, prefer", [
    (15, 14, 0.05, "direct"),  # p_direct 0.70 == p_think 0.75 - 0.05: exactly at the margin -> direct
    (15, 13, 0.05, "think"),   # 0.65 < 0.70: just outside
    (15, 15, 0.05, "direct"),  # equal
    (15, 14, 0.0, "think"),    # no margin: direct must be at least as good
    (15, 16, 0.0, "direct"),   # direct better
    (10, 0, 0.5, "direct"),    # 0.0 >= 0.5 - 0.5
    (11, 0, 0.5, "think"),     # 0.0 < 0.55 - 0.5
])
def test_preferred_mode_flips_exactly_at_the_margin(think_pass, direct_pass, margin, prefer):
    cfg = AutoThinkConfig(**{**vars(CFG), "margin": margin})
    res = mode_selection_rewards([auto(DIRECT, True, 3), auto(THINK, True, 12)],
                                 forced(FORCED_THINK, think_pass, 20 - think_pass),
                                 forced(FORCED_DIRECT, direct_pass, 20 - direct_pass), cfg)
    assert res.p_think == think_pass / 20 and res.p_direct == direct_pass / 20
    assert res.prefer == prefer
    # the bonus follows the preference; thinking 12 tokens on an easy question costs 0.5 * 8 / 20 = 0.2
    expected = [1.5, 0.8] if prefer == "direct" else [1.0, 1.5]
    assert rewards(res) == pytest.approx(expected)


def test_auto_replies_join_the_estimates_by_the_mode_they_chose():
    cfg = AutoThinkConfig(**{**vars(CFG), "include_auto": True})
    replies = [auto(DIRECT, False, 3), auto(DIRECT, False, 3), auto(THINK, True, 9), auto(THINK_NO_ANALYSIS, True, 9),
               auto(DIRECT, True, 3, valid=False), auto(DIRECT, True, 3, fresh=False)]
    res = mode_selection_rewards(replies, forced(FORCED_THINK, 1, 1), forced(FORCED_DIRECT, 2, 0), cfg)
    # think: forced 1/2 + auto thinking 2/2 (the malformed one thought too) = 3/4; direct: forced 2/2 + fresh
    # valid auto direct 0/2 = 2/4 (the invalid row and the replayed one do not count)
    assert (res.p_think, res.n_think, res.p_direct, res.n_direct) == (0.75, 4, 0.5, 4)
    assert res.prefer == "think"  # 0.5 < 0.75 - 0.05
    # wrong direct: 0, 0; correct thinking: 1.5; correct thinking without analysis: 1 - 0.5 (format), no bonus;
    # invalid: 0; the replayed correct direct reply is rewarded like a fresh one: 1, no bonus (think preferred)
    assert rewards(res) == pytest.approx([0.0, 0.0, 1.5, 0.5, 0.0, 1.0])
    assert res.auto[4].decision is None


# ----------------------------------------------------------------------------------- dominance / format
def test_a_correct_reply_always_beats_a_wrong_one_of_the_same_format():
    texts = {"direct": DIRECT, "think": THINK}
    for tp, dp, margin in itertools.product(range(5), range(5), (0.0, 0.05, 0.3)):
        cfg = AutoThinkConfig(**{**vars(CFG), "margin": margin, "length_penalty": 0.9})
        replies = [auto(texts[d], ok, n) for d, ok, n in itertools.product(texts, (True, False), (1, 8, 40, 400))]
        res = mode_selection_rewards(replies, forced(FORCED_THINK, tp, 4 - tp), forced(FORCED_DIRECT, dp, 4 - dp), cfg)
        right = [a.reward for a, r in zip(res.auto, replies) if r.passed]
        wrong = [a.reward for a, r in zip(res.auto, replies) if not r.passed]
        assert min(right) > max(wrong), (tp, dp, margin)


def test_malformed_auto_replies_get_the_format_penalty_and_no_bonus():
    replies = [auto(NO_ANALYSIS, True, 2), auto(THINK_NO_ANALYSIS, True, 24), auto(INCONSISTENT, True, 4),
               auto("<analysis></analysis>7", True, 3), auto(NO_ANALYSIS, False, 2)]
    res = mode_selection_rewards(replies, forced(FORCED_THINK, 4, 0), forced(FORCED_DIRECT, 4, 0), CFG)
    assert res.prefer == "direct" and not any(a.well_formed for a in res.auto)
    # correct direct without analysis: 1 - 0.5; thinking without analysis 24 tokens: 1 - 0.5 (length) - 0.5;
    # analysis says /think but answers directly: 1 - 0.5; empty analysis block: 1 - 0.5; wrong: 0 - 0.5
    assert rewards(res) == pytest.approx([0.5, 0.0, 0.5, 0.5, -0.5])
    assert [a.format_penalty for a in res.auto] == [0.5] * 5 and [a.bonus for a in res.auto] == [0.0] * 5
    # the same correct reply well formed gets 1.5: the penalty + the lost bonus separate them
    ok = mode_selection_rewards([auto(DIRECT, True, 2)], forced(FORCED_THINK, 4, 0), forced(FORCED_DIRECT, 4, 0), CFG)
    assert rewards(ok) == [1.5]


# ------------------------------------------------------------------------------------------- degenerate
def test_no_forced_replies_means_no_preference():
    replies = [auto(DIRECT, True, 3), auto(THINK, True, 30), auto(NO_ANALYSIS, True, 1)]
    res = mode_selection_rewards(replies, [], [], CFG)
    assert (res.p_think, res.p_direct, res.prefer) == (None, None, None)
    assert rewards(res) == pytest.approx([1.0, 1.0, 0.5])  # only the format penalty applies
    # forced groups made only of invalid (missing replay) rows count as empty
    invalid = [Reply("", 0, False, 0.0, valid=False)] * 3
    assert mode_selection_rewards(replies, invalid, invalid, CFG).prefer is None
    # one estimate only: still no preference
    assert mode_selection_rewards(replies, forced(FORCED_THINK, 2, 0), [], CFG).prefer is None


def test_estimates_from_auto_replies_alone():
    cfg = AutoThinkConfig(**{**vars(CFG), "include_auto": True, "think_samples": 0, "direct_samples": 0})
    replies = [auto(DIRECT, True, 3), auto(DIRECT, True, 3), auto(THINK, True, 14), auto(THINK, False, 14)]
    res = mode_selection_rewards(replies, [], [], cfg)
    assert (res.p_direct, res.p_think, res.prefer) == (1.0, 0.5, "direct")
    assert rewards(res) == pytest.approx([1.5, 1.5, 1.0 - 0.25, 0.0 - 0.25])
    only_direct = mode_selection_rewards(replies[:2], [], [], cfg)
    assert only_direct.p_think is None and only_direct.prefer is None and rewards(only_direct) == [1.0, 1.0]


def test_all_invalid_or_empty_auto_groups():
    res = mode_selection_rewards([Reply("", 0, False, 0.0, valid=False)] * 2, forced(FORCED_THINK, 1, 0),
                                 forced(FORCED_DIRECT, 1, 0), CFG)
    assert rewards(res) == [0.0, 0.0] and [a.decision for a in res.auto] == [None, None]
    assert mode_selection_rewards([], forced(FORCED_THINK, 1, 0), forced(FORCED_DIRECT, 0, 1), CFG).auto == []


@pytest.mark.parametrize("field, value", [("margin", -0.1), ("margin", 1.5), ("mode_bonus", -1.0),
                                          ("length_penalty", float("nan")), ("think_samples", -1),
                                          ("length_scale", 0), ("format_penalty", -0.5)])
def test_bad_config_values_are_named(field, value):
    cfg = AutoThinkConfig(**{**vars(CFG), field: value})
    with pytest.raises(KeyeConfigError, match=f"algorithm.autothink.{field}"):
        cfg.check()


def test_config_needs_some_estimate_and_a_length_scale():
    with pytest.raises(KeyeConfigError, match="include_auto=false"):
        AutoThinkConfig(think_samples=0, include_auto=False).check()
    AutoThinkConfig(think_samples=0, direct_samples=0, include_auto=True).check()
    with pytest.raises(KeyeConfigError, match="length_scale"):
        mode_selection_rewards([], [], [], AutoThinkConfig())
    assert mode_selection_rewards([], [], [], AutoThinkConfig(), length_scale=16).prefer is None


# ---------------------------------------------------------------------------------- loop helpers
def _sample(q: int, role: str, text: str, passed: bool, reward: float, source: str = "rollout",
            valid: bool = True) -> RolloutSample:
    ids = torch.arange(len(text) if valid else 0)
    return RolloutSample(prompt=RLPrompt(f"q{q}", [{"role": "user", "content": "?"}]), group=group_id(q, role),
                         inputs=PromptInputs(torch.tensor([1, 2])), response_ids=ids, text=text, finished=True,
                         source=source, valid=valid, reward=reward, passed=passed,
                         metadata={} if source == "replay" else {"autothink_role": role})


def test_link_groups_flatten_signal_and_metrics():
    samples = [  # question 0 easy (both modes pass), question 1: direct fails
        _sample(0, "auto", DIRECT, True, 1.0), _sample(0, "auto", THINK, True, 1.0),
        _sample(0, "auto", DIRECT, True, 1.0, source="replay"), _sample(0, "auto", "", False, 0.0, "replay", False),
        _sample(0, "think", FORCED_THINK, True, 1.0), _sample(0, "think", FORCED_THINK, True, 1.0),
        _sample(0, "direct", FORCED_DIRECT, True, 1.0), _sample(0, "direct", FORCED_DIRECT, True, 1.0),
        _sample(1, "auto", THINK, True, 1.0), _sample(1, "auto", THINK, True, 1.0),
        _sample(1, "think", FORCED_THINK, True, 1.0), _sample(1, "think", FORCED_THINK, True, 1.0),
        _sample(1, "direct", FORCED_DIRECT, False, 0.0), _sample(1, "direct", FORCED_DIRECT, False, 0.0),
    ]
    linked = link_groups(samples, 2, CFG, length_scale=20)
    assert [len(x) for x in linked] == [8, 6] and all(s.prompt.id == "q0" for s in linked[0])
    r0 = [s.reward for s in linked[0]]
    # THINK is 55 characters -> 55 "tokens" here: full length penalty 0.5; the replayed direct reply gets the bonus
    assert r0 == pytest.approx([1.5, 0.5, 1.5, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert linked[0][1].metadata["autothink_base_reward"] == 1.0
    assert [s.reward for s in linked[1]] == pytest.approx([1.5, 1.5, 1.0, 1.0, 0.0, 0.0])
    assert linked[1][0].metadata["autothink_question"]["prefer"] == "think"
    # question 1: auto replies all 1.5, forced think all passed, forced direct all failed: no group has a
    # signal, so dynamic sampling is shown the (equal) auto rewards and drops the question
    assert group_signal(linked[1], "accuracy", train_forced=True) == [1.5, 1.5]
    assert group_signal(linked[0], "accuracy", train_forced=True) == [1.5, 0.5, 1.5]
    flat, n = flatten(linked, train_forced=True)
    assert n == 6 and [s.group for s in flat] == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    flat, n = flatten(linked, train_forced=False)
    assert n == 2 and [s.group for s in flat] == [0, 0, 0, 0, 1, 1]
    m = finish_metrics(metric_sums(linked))
    assert m["autothink/think_rate"] == pytest.approx(3 / 4)  # fresh valid auto replies only
    assert m["autothink/auto_accuracy"] == 1.0
    assert m["autothink/p_think"] == 1.0 and m["autothink/p_direct"] == pytest.approx(0.5)
    assert m["autothink/prefer_direct"] == 0.5 and m["autothink/mode_match"] == pytest.approx(3 / 4)
    assert m["autothink/mean_reply_tokens"] == pytest.approx((len(DIRECT) + 3 * len(THINK)) / 4)
    assert m["autothink/forced_direct_accuracy"] == 0.5
    rows = question_records(linked, step=3)
    assert [r["question"] for r in rows] == ["q0", "q1"] and rows[0]["step"] == 3
    again = mode_selection_rewards(*(replies_of(rows[0], role) for role in ("auto", "think", "direct")), CFG,
                                   length_scale=20)
    assert [a.reward for a in again.auto] == [x["reward"] for x in rows[0]["groups"]["auto"]]
    with pytest.raises(KeyeInputError, match="group id"):
        link_groups([_sample(2, "auto", DIRECT, True, 1.0)], 2, CFG, length_scale=20)


class _Engine:
    """Records each generate call and answers every prompt n times (text = its mode and reply index)."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n):
        self.calls.append(([(p.id, p.mode) for p in prompts], n))
        return [RolloutSample(prompt=p, group=i, inputs=PromptInputs(torch.tensor([1])), response_ids=torch.tensor([5]),
                              text=f"{p.response_prefix or ''}{p.mode}{k}", finished=True)
                for i, p in enumerate(prompts) for k in range(n)]


@pytest.mark.parametrize("G, think_n, direct_n, n_calls", [(2, 2, 2, 1), (2, 3, 2, 2), (3, 1, 0, 2), (1, 0, 0, 1)])
def test_generate_links_three_groups_per_question(G, think_n, direct_n, n_calls):
    from keye.rl.algorithms.autothink import generate

    prompts = [RLPrompt(f"q{i}", [{"role": "user", "content": "How many? /think"}], mode=None) for i in range(3)]
    engine = _Engine()
    cfg = AutoThinkConfig(think_samples=think_n, direct_samples=direct_n)
    out = generate(engine, prompts, G, cfg)
    assert len(engine.calls) == n_calls  # roles with equal counts share a call
    assert sorted(m for call, _ in engine.calls for _, m in call) == sorted(
        ["auto"] * 3 + ["think"] * 3 * (think_n > 0) + ["no_think"] * 3 * (direct_n > 0))
    expected = []  # (group id, question id, role, mode, text) worked out from the layout 3 * question + role
    for q in range(3):
        for r, (role, mode, n) in enumerate((("auto", "auto", G), ("think", "think", think_n),
                                             ("direct", "no_think", direct_n))):
            expected += [(3 * q + r, f"q{q}", role, mode, f"{mode}{k}") for k in range(n)]
    got = [(s.group, s.prompt.id, s.metadata["autothink_role"], s.prompt.mode, s.text) for s in out]
    assert got == expected
    assert prompts[0].mode is None  # the caller's prompts are not modified


def test_generate_explores_the_decision():
    from keye.rl.algorithms.autothink import generate

    prompts = [RLPrompt(f"q{i}", [{"role": "user", "content": "How many?"}]) for i in range(2)]
    engine = _Engine()
    cfg = AutoThinkConfig(think_samples=2, direct_samples=2, explore=2, think_prefix="<T>", direct_prefix="<D>")
    out = generate(engine, prompts, 4, cfg)
    # 2 free auto replies + 1 forced each way: free auto, think and direct (2 each) share a call, the explored halves another
    assert sorted(n for _, n in engine.calls) == [1, 2]
    auto = [s for s in out if s.group == 0]
    assert [s.text for s in auto] == ["auto0", "auto1", "<T>auto0", "<D>auto0"]
    assert [s.metadata.get("autothink_forced") for s in auto] == [None, None, "think", "direct"]
    assert all(s.prompt.response_prefix is None for s in out if s.metadata["autothink_role"] != "auto")
    assert [s.group for s in out] == sorted(s.group for s in out) and len(out) == 2 * (4 + 2 + 2)
    with pytest.raises(KeyeConfigError, match="explore"):
        generate(engine, prompts, 1, cfg)  # more forced replies than G
    for bad in (-2, 1, 3):
        with pytest.raises(KeyeConfigError, match="algorithm.autothink.explore"):
            AutoThinkConfig(explore=bad).check()
    with pytest.raises(KeyeConfigError, match="think_prefix"):
        AutoThinkConfig(explore=2, think_prefix="").check()


def test_free_think_rate_counts_only_the_policys_own_decisions():
    def sample(text, forced=None):
        s = RolloutSample(prompt=RLPrompt("q", []), group=0, inputs=PromptInputs(torch.tensor([1])),
                          response_ids=torch.tensor([5, 6]), text=text, finished=True, reward=1.0, passed=True)
        s.metadata.update(autothink_role="auto", autothink={"decision": "think" if "<think>" in text else "direct",
                                                             "well_formed": True})
        if forced:
            s.metadata["autothink_forced"] = forced
        return s

    members = [sample(DIRECT), sample(DIRECT), sample(THINK, "think"), sample(DIRECT, "direct")]
    m = finish_metrics(metric_sums([members]))
    assert m["autothink/think_rate"] == pytest.approx(1 / 4)
    assert m["autothink/free_think_rate"] == 0.0
    rows = question_records([members], step=3)
    assert [r["forced"] for r in rows[0]["groups"]["auto"]] == [None, None, "think", "direct"]


# ------------------------------------------------------------------ the expected decision gap (exact vs sampled)
def _sampled_gap(pt: float, pd: float, cfg: AutoThinkConfig, *, G: int, q: float, trials: int,
                 think_tokens: int, scale: int) -> tuple[float, float]:
    """Monte Carlo of the same expectation through mode_selection_rewards itself: mean reward of the auto replies
    that thought minus that of those that answered directly, and its standard error."""
    rng = random.Random(7)
    by: dict[str, list[float]] = {"think": [], "direct": []}
    for _ in range(trials):
        think = [Reply(FORCED_THINK, think_tokens, rng.random() < pt, 0.0) for _ in range(cfg.think_samples)]
        direct = [Reply(FORCED_DIRECT, 2, rng.random() < pd, 0.0) for _ in range(cfg.direct_samples)]
        auto = []
        for _ in range(G):
            thinks = rng.random() < q
            ok = rng.random() < (pt if thinks else pd)
            auto.append(Reply(THINK if thinks else DIRECT, think_tokens if thinks else 12, ok, float(ok)))
        for a in mode_selection_rewards(auto, think, direct, cfg, length_scale=scale).auto:
            by[a.decision].append(a.reward)
    mean = {k: sum(v) / len(v) for k, v in by.items()}
    var = {k: sum((x - mean[k]) ** 2 for x in v) / (len(v) - 1) / len(v) for k, v in by.items()}
    return mean["think"] - mean["direct"], math.sqrt(var["think"] + var["direct"])


@pytest.mark.parametrize("pt, pd, cfg", [
    (0.44, 0.37, AutoThinkConfig(length_scale=32)),  # the defaults: thinking loses at a 7-point edge
    (0.44, 0.37, AutoThinkConfig(length_scale=32, length_penalty=0.1, mode_bonus=1.0, think_samples=8,
                                 direct_samples=8)),
    (0.6, 0.2, AutoThinkConfig(length_scale=32, include_auto=False, margin=0.0)),
    (0.9, 0.9, AutoThinkConfig(length_scale=32, length_budget=20, think_samples=2, direct_samples=6)),
])
def test_expected_decision_gap_equals_the_sampled_reward(pt, pd, cfg):
    exact = expected_decision_gap(pt, pd, cfg, G=4, think_share=0.4, think_tokens=36)
    sampled, se = _sampled_gap(pt, pd, cfg, G=4, q=0.4, trials=3000, think_tokens=36, scale=32)
    assert abs(exact - sampled) < 4 * se + 1e-9, (exact, sampled, se)


def test_expected_decision_gap_closed_forms():
    # no bonus, no penalty: choosing a mode is worth exactly its pass rate
    plain = AutoThinkConfig(length_scale=32, mode_bonus=0.0, length_penalty=0.0)
    assert expected_decision_gap(0.7, 0.2, plain) == pytest.approx(0.5)
    assert expected_decision_gap(0.7, 0.2, plain, accuracy=2.0) == pytest.approx(1.0)
    # both modes always pass: direct is always preferred, so thinking loses the bonus and pays the full penalty
    cfg = AutoThinkConfig(length_scale=32)
    assert expected_decision_gap(1.0, 1.0, cfg, think_tokens=64) == pytest.approx(-cfg.mode_bonus - cfg.length_penalty)
    # thinking always passes, direct never: thinking is always preferred and gets accuracy + bonus
    assert expected_decision_gap(1.0, 0.0, cfg) == pytest.approx(1.0 + cfg.mode_bonus)


def test_break_even_edge():
    cfg = AutoThinkConfig(length_scale=32)
    edge = break_even_edge(0.4, cfg, think_tokens=36)
    assert 0.0 < edge < 0.6
    assert expected_decision_gap(0.4 + edge, 0.4, cfg, think_tokens=36) >= 0
    assert expected_decision_gap(0.4 + edge - 2e-3, 0.4, cfg, think_tokens=36) < 0
    # a smaller penalty and a larger bonus make a smaller edge pay
    cheap = AutoThinkConfig(length_scale=32, length_penalty=0.1, mode_bonus=1.0)
    assert break_even_edge(0.4, cheap, think_tokens=36) < edge
    # both modes sure to pass: thinking never pays; no penalty, no bonus: it pays at any positive edge
    assert break_even_edge(1.0, cfg) is None
    assert break_even_edge(0.4, AutoThinkConfig(length_scale=32, mode_bonus=0.0, length_penalty=0.0)) == 0.0
    for bad in (dict(p_think=1.2, p_direct=0.4), dict(p_think=0.5, p_direct=-0.1)):
        with pytest.raises(KeyeConfigError, match="must be in"):
            expected_decision_gap(cfg=cfg, **bad)
    with pytest.raises(KeyeConfigError, match="length_scale"):
        expected_decision_gap(0.5, 0.5, AutoThinkConfig())
    with pytest.raises(KeyeConfigError, match="G must be"):
        expected_decision_gap(0.5, 0.5, cfg, G=0)
