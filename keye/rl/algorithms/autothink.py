"""AutoThink: reward an auto-mode reply for being correct *and* for choosing the cheaper thinking mode that still
solves the question (issue #22; the formula and its sources are in ``docs/autothink.md``).

Every drawn RL question becomes three linked groups of the same question id (:func:`generate`):

- ``auto``: ``rollout.G`` replies to the prompt without a mode switch (the reply opens with Keye's
  ``<analysis>`` block, then either thinks or answers directly);
- ``think``: ``think_samples`` replies to the prompt ending in ``/think``;
- ``direct``: ``direct_samples`` replies to the prompt ending in ``/no_think``.

The forced groups estimate each mode's pass rate on this question under the current policy (plus, with
``include_auto``, the fresh auto replies counted by the mode they chose). Direct answering is *preferred* when
``p_direct >= p_think - margin`` (AdaptThink's constraint with its delta = 0.05 as the margin), thinking
otherwise. An auto reply's reward is its ordinary reward (the configured :class:`keye.rewards.RewardSpec`
total) plus

- ``+ mode_bonus`` when it is correct, well formed and chose the preferred mode;
- ``- length_penalty * min(1, max(0, tokens - length_budget) / length_scale)`` when it thinks on a question
  where direct answering is preferred (longer thinking on an easy question costs more);
- ``- format_penalty`` when it is not a well-formed auto reply (no analysis block first, broken tags, or an
  analysis that names ``/think`` / ``/no_think`` and then does the other: :func:`keye.rewards.format.check_format`
  in ``auto`` mode).

With ``explore`` > 0, that many of the ``G`` auto replies have their decision forced (half start with
``think_prefix``, half with ``direct_prefix``: :attr:`keye.rl.rollout.samples.RLPrompt.response_prefix`), so both decisions
stay in every auto group (AdaptThink's balanced decision sampling) and the decision token keeps being compared
after the policy has settled.

Forced replies keep their ordinary reward and, with ``train_forced``, are trained as groups of their own (own
advantage normalisation), so both modes stay trained. :func:`mode_selection_rewards` is the pure reward on
plain :class:`Reply` records (unit-tested on constructed groups); :func:`link_groups`, :func:`group_signal`,
:func:`flatten`, :func:`metric_sums` / :func:`finish_metrics` and :class:`GroupLog` are what the in-process
loop of :mod:`keye.recipes.rlep` calls.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError, KeyeInputError
from keye.processing.chat import parse_response
from keye.rewards.format import check_format
from keye.rl.rollout.samples import RLPrompt, RolloutSample

ROLES = ("auto", "think", "direct")
#: the prompt mode (:func:`keye.processing.chat.apply_mode`) each linked group is sampled in
ROLE_MODES = {"auto": "auto", "think": "think", "direct": "no_think"}
#: ties of p_direct with p_think - margin (up to float rounding) count as "within the margin"
_TIE = 1e-9


@dataclass
class AutoThinkConfig:
    """``algorithm.autothink``: the mode-selection reward and its linked groups (default off).

    Defaults marked "ours" have no published value; see ``docs/autothink.md`` for the reasoning.
    """

    enabled: bool = False
    think_samples: int = 4  # forced /think replies per question (estimate of thinking's pass rate); ours
    direct_samples: int = 4  # forced /no_think replies per question (estimate of answering directly); ours
    margin: float = 0.05  # direct preferred when p_direct >= p_think - margin; AdaptThink's delta (arXiv 2505.13417)
    mode_bonus: float = 0.5  # added to a correct, well-formed auto reply that chose the preferred mode; ours
    length_penalty: float = 0.5  # largest penalty for thinking where direct is preferred (< accuracy weight); ours
    length_budget: int = 0  # reply tokens a thinking reply may spend on an easy question before the penalty; ours
    length_scale: int | None = None  # tokens over the budget at which the penalty is full; None: rollout.max_new_tokens
    format_penalty: float = 0.5  # subtracted from an auto reply that is not a well-formed auto reply; ours
    include_auto: bool = True  # fresh auto replies join the pass-rate estimates by the mode they chose; ours
    train_forced: bool = True  # forced groups are trained too (Keye mix-mode RL keeps both modes trained)
    record: bool = True  # write every question's linked groups to <out_dir>/autothink_groups.jsonl
    # Exploration of the decision (AdaptThink's balanced first-token sampling, arXiv 2505.13417 sec. 3.2): this
    # many of the G auto replies have their decision forced, half by each prefix, so both decisions stay in
    # every auto group however far the policy has moved. 0 = off; ours
    explore: int = 0
    think_prefix: str = "<analysis>/think</analysis>"  # the forced start of an explored thinking reply; ours
    direct_prefix: str = "<analysis>/no_think</analysis>"  # the forced start of an explored direct reply; ours

    def check(self, where: str = "algorithm.autothink") -> None:
        """Raise :class:`KeyeConfigError` naming ``where.<field>`` for an out-of-range value."""
        if self.explore < 0 or self.explore % 2:
            raise KeyeConfigError(f"{where}.explore must be an even number >= 0 (half the explored auto replies "
                                  f"think, half answer directly), got {self.explore}")
        for name in ("think_prefix", "direct_prefix"):
            if self.explore and not getattr(self, name):
                raise KeyeConfigError(f"{where}.{name} must be a non-empty text when explore > 0")
        for name in ("think_samples", "direct_samples", "length_budget"):
            if getattr(self, name) < 0:
                raise KeyeConfigError(f"{where}.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("mode_bonus", "length_penalty", "format_penalty"):
            v = getattr(self, name)
            if not v >= 0:  # also rejects NaN
                raise KeyeConfigError(f"{where}.{name} must be >= 0, got {v}")
        if not 0.0 <= self.margin <= 1.0:
            raise KeyeConfigError(f"{where}.margin must be in [0, 1] (a difference of pass rates), got {self.margin}")
        if self.length_scale is not None and self.length_scale < 1:
            raise KeyeConfigError(f"{where}.length_scale must be >= 1 (tokens) or null, got {self.length_scale}")
        if not self.include_auto and (self.think_samples == 0 or self.direct_samples == 0):
            raise KeyeConfigError(f"{where}: with include_auto=false both think_samples and direct_samples must be "
                                  f">= 1, or no question ever has both pass rates (got {self.think_samples}, "
                                  f"{self.direct_samples})")


# ------------------------------------------------------------------------------------------- the reward
@dataclass
class Reply:
    """One reply as the reward sees it: ``text`` (decoded response), ``tokens`` (response length),
    ``passed`` (verified correct: the scorer's accuracy check), ``reward`` (its ordinary reward),
    ``valid`` (False: a missing replay slot, ignored), ``fresh`` (sampled now; replayed replies are
    rewarded like fresh ones but never enter the pass-rate estimates, being pool-selected successes)."""

    text: str
    tokens: int
    passed: bool
    reward: float
    valid: bool = True
    fresh: bool = True


@dataclass
class AutoReplyScore:
    """The mode-selection reward of one auto reply: ``reward`` = base + ``bonus`` - ``length_penalty`` -
    ``format_penalty``; ``decision`` "think" / "direct" (None for an invalid reply); ``well_formed``."""

    reward: float
    decision: str | None
    well_formed: bool
    bonus: float = 0.0
    length_penalty: float = 0.0
    format_penalty: float = 0.0


@dataclass
class QuestionRewards:
    """Per question: the pass-rate estimates (None without any reply of that mode), how many replies each
    rests on, the preferred mode ("direct" / "think", None when either estimate is missing) and one
    :class:`AutoReplyScore` per auto reply (same order)."""

    p_think: float | None
    p_direct: float | None
    n_think: int
    n_direct: int
    prefer: str | None
    auto: list[AutoReplyScore] = field(default_factory=list)


def decision_of(text: str) -> str:
    """The mode a reply used: "think" when it has a non-empty ``<think>`` block, else "direct"
    (:func:`keye.processing.chat.parse_response`, which also reads replies with an analysis block)."""
    return "think" if parse_response(text).mode in ("think", "auto_think") else "direct"


def is_well_formed_auto(text: str) -> bool:
    """Whether ``text`` passes the auto-mode format check (analysis block first, well-formed tags, a choice
    consistent with the analysis): :func:`keye.rewards.format.check_format` with mode ``auto``."""
    return check_format(text, "auto", auto_requires_analysis=True)[0] == 1.0


def _rate(replies: Sequence[Reply]) -> tuple[int, int]:
    live = [r for r in replies if r.valid and r.fresh]
    return sum(bool(r.passed) for r in live), len(live)


def mode_selection_rewards(auto: Sequence[Reply], think: Sequence[Reply], direct: Sequence[Reply],
                           cfg: AutoThinkConfig, *, length_scale: int | None = None) -> QuestionRewards:
    """The AutoThink reward of one question's auto replies from its linked groups.

    Args:
        auto / think / direct: the question's auto-mode replies and its forced ``/think`` and ``/no_think``
            replies (either forced list may be empty).
        cfg: the constants. length_scale: overrides ``cfg.length_scale`` (the loop passes
            ``rollout.max_new_tokens`` when the config leaves it None).
    Returns:
        :class:`QuestionRewards`. ``p_think`` = passes / replies over the fresh valid forced-think replies (plus,
        with ``cfg.include_auto``, the fresh valid auto replies that thought); ``p_direct`` likewise. Invalid
        auto replies get reward 0 and decision None. A question without both estimates has no preferred mode:
        no bonus and no length penalty, only the format penalty.
    Raises:
        KeyeConfigError: no length scale (neither argument nor config), or a config out of range.
    """
    cfg.check()
    scale = length_scale if length_scale is not None else cfg.length_scale
    if scale is None or scale < 1:
        raise KeyeConfigError(f"algorithm.autothink.length_scale must be >= 1 tokens, got {scale}")
    decisions = [decision_of(r.text) if r.valid else None for r in auto]
    pt, nt = _rate(think)
    pd, nd = _rate(direct)
    if cfg.include_auto:
        for r, d in zip(auto, decisions):
            if r.valid and r.fresh:
                if d == "think":
                    pt, nt = pt + bool(r.passed), nt + 1
                else:
                    pd, nd = pd + bool(r.passed), nd + 1
    p_think = pt / nt if nt else None
    p_direct = pd / nd if nd else None
    prefer = None
    if p_think is not None and p_direct is not None:
        prefer = "direct" if p_direct >= p_think - cfg.margin - _TIE else "think"
    out = QuestionRewards(p_think, p_direct, nt, nd, prefer)
    for r, d in zip(auto, decisions):
        if not r.valid:
            out.auto.append(AutoReplyScore(0.0, None, False))
            continue
        ok = is_well_formed_auto(r.text)
        # the bonus rewards a decision that led to a verified answer: a wrong reply in the "right" mode gets none
        bonus = cfg.mode_bonus if (ok and r.passed and prefer is not None and d == prefer) else 0.0
        over = max(0, int(r.tokens) - cfg.length_budget)
        lp = cfg.length_penalty * min(1.0, over / scale) if (prefer == "direct" and d == "think") else 0.0
        fp = 0.0 if ok else cfg.format_penalty
        out.auto.append(AutoReplyScore(float(r.reward) + bonus - lp - fp, d, ok, bonus, lp, fp))
    return out


def _binom(n: int, p: float) -> list[float]:
    return [math.comb(n, k) * p ** k * (1.0 - p) ** (n - k) for k in range(n + 1)]


def expected_decision_gap(p_think: float, p_direct: float, cfg: AutoThinkConfig, *, G: int = 4,
                          think_share: float = 0.5, think_tokens: int = 40, direct_tokens: int = 12,
                          length_scale: int | None = None, accuracy: float = 1.0) -> float:
    """What the reward pays for *choosing* to think: E[r | the auto reply thinks] - E[r | it answers directly].

    Exact expectation (no sampling) of :func:`mode_selection_rewards` for one auto reply of a question whose true
    pass rates are ``p_think`` / ``p_direct``, over everything the reward's estimates see: ``cfg.think_samples`` /
    ``cfg.direct_samples`` forced replies, the reply's own outcome and the ``G - 1`` other auto replies, each
    thinking with probability ``think_share`` (pooled into the estimates when ``cfg.include_auto``). Replies are
    well formed, thinking replies are ``think_tokens`` long, direct ones ``direct_tokens``, and the base reward is
    ``accuracy`` for a pass, 0 otherwise. The group baseline is the same for both choices, so the sign of the gap
    is the sign of the policy-gradient push on the decision: positive, the loop teaches thinking on such questions.

    Use it to check a config against a model before training: with the pass rates a model actually has under
    rollout sampling, a negative gap everywhere means RL will teach it to answer directly everywhere
    (docs/autothink.md, "What the reward can learn").

    Raises:
        KeyeConfigError: a probability outside [0, 1], ``G`` < 1, or no length scale.
    """
    cfg.check()
    for name, v in (("p_think", p_think), ("p_direct", p_direct), ("think_share", think_share)):
        if not 0.0 <= v <= 1.0:
            raise KeyeConfigError(f"{name} must be in [0, 1], got {v}")
    if G < 1:
        raise KeyeConfigError(f"G must be >= 1, got {G}")
    scale = length_scale if length_scale is not None else cfg.length_scale
    if scale is None or scale < 1:
        raise KeyeConfigError(f"length_scale must be >= 1 tokens, got {scale}")
    pen = cfg.length_penalty * min(1.0, max(0, think_tokens - cfg.length_budget) / scale)
    forced_t, forced_d = _binom(cfg.think_samples, p_think), _binom(cfg.direct_samples, p_direct)
    # the other auto replies: a of them think, j of those pass, k of the G-1-a direct ones pass
    others = [(pa * pj * pk, a, j, k)
              for a, pa in enumerate(_binom(G - 1, think_share) if cfg.include_auto else [1.0] + [0.0] * (G - 1))
              for j, pj in enumerate(_binom(a, p_think)) for k, pk in enumerate(_binom(G - 1 - a, p_direct))]
    value = {}
    for choice, p_own in (("think", p_think), ("direct", p_direct)):
        total = 0.0
        for passed, p_pass in ((1, p_own), (0, 1.0 - p_own)):
            if p_pass == 0.0:
                continue
            own_t, own_d = (1, 0) if choice == "think" else (0, 1)
            for kt, pkt in enumerate(forced_t):
                for kd, pkd in enumerate(forced_d):
                    for po, a, j, k in others:
                        w = p_pass * pkt * pkd * po
                        if w == 0.0:
                            continue
                        auto_in = cfg.include_auto
                        nt = cfg.think_samples + (a + own_t if auto_in else 0)
                        nd = cfg.direct_samples + (G - 1 - a + own_d if auto_in else 0)
                        st = kt + (j + own_t * passed if auto_in else 0)
                        sd = kd + (k + own_d * passed if auto_in else 0)
                        r = accuracy * passed
                        if nt and nd:
                            prefer = "direct" if sd / nd >= st / nt - cfg.margin - _TIE else "think"
                            r += cfg.mode_bonus if (passed and prefer == choice) else 0.0
                            r -= pen if (prefer == "direct" and choice == "think") else 0.0
                        total += w * r
        value[choice] = total
    return value["think"] - value["direct"]


def break_even_edge(p_direct: float, cfg: AutoThinkConfig, *, tol: float = 1e-4, **kw: Any) -> float | None:
    """The smallest ``p_think - p_direct`` at which :func:`expected_decision_gap` is >= 0 (the reward starts to
    favour thinking), found by bisection on ``p_think`` in ``[p_direct, 1]``; ``kw`` as for
    :func:`expected_decision_gap`. None when even ``p_think = 1`` does not make thinking pay; 0.0 when thinking
    already pays at equal pass rates."""
    gap = lambda pt: expected_decision_gap(pt, p_direct, cfg, **kw)  # noqa: E731
    if gap(p_direct) >= 0:
        return 0.0
    if gap(1.0) < 0:
        return None
    lo, hi = p_direct, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gap(mid) >= 0 else (mid, hi)
    return hi - p_direct


# ------------------------------------------------------------------------------------- loop integration
def expand(prompts: Sequence[RLPrompt]) -> dict[str, list[RLPrompt]]:
    """Per role the copies of ``prompts`` in that role's mode (``auto`` / ``think`` / ``no_think``); ids kept,
    so the three linked groups of a question share its id (the replay pool's key)."""
    return {role: [dataclasses.replace(p, mode=ROLE_MODES[role]) for p in prompts] for role in ROLES}


def group_id(question: int, role: str) -> int:
    """The rollout group id of ``role``'s group of the ``question``-th prompt of a rollout call."""
    return question * len(ROLES) + ROLES.index(role)


def generate(engine: Any, prompts: Sequence[RLPrompt], G: int, cfg: AutoThinkConfig) -> list[RolloutSample]:
    """Sample the linked groups of every prompt: ``G`` auto replies, ``cfg.think_samples`` forced-think and
    ``cfg.direct_samples`` forced-direct replies. Roles with the same count share one engine call (with the
    defaults G = 4 = think = direct, a single call: bigger decode batches); a role with 0 replies is skipped.

    Returns the samples ordered by group id (question, then role auto / think / direct), ``group`` set by
    :func:`group_id` and ``metadata["autothink_role"]`` set; deterministic for a seeded engine.
    """
    if cfg.explore > G:
        raise KeyeConfigError(f"algorithm.autothink.explore ({cfg.explore}) must be <= rollout.G ({G})")
    roles = expand(prompts)
    half = cfg.explore // 2
    # (role, forced decision, prompts, replies each): explored auto replies are auto prompts with a forced prefix
    parts = [("auto", None, roles["auto"], G - cfg.explore),
             ("auto", "think", [dataclasses.replace(p, response_prefix=cfg.think_prefix) for p in roles["auto"]], half),
             ("auto", "direct", [dataclasses.replace(p, response_prefix=cfg.direct_prefix) for p in roles["auto"]], half),
             ("think", None, roles["think"], cfg.think_samples), ("direct", None, roles["direct"], cfg.direct_samples)]
    calls: dict[int, list[int]] = {}
    for k, part in enumerate(parts):
        if part[3] >= 1 and prompts:
            calls.setdefault(part[3], []).append(k)
    out: list[RolloutSample] = []
    n = len(prompts)
    for count, members in calls.items():
        batch = [p for k in members for p in parts[k][2]]
        for s in engine.generate(batch, count):
            role, forced = parts[members[s.group // n]][:2]
            s.group = group_id(s.group % n, role)
            s.metadata["autothink_role"] = role
            if forced is not None:
                s.metadata["autothink_forced"] = forced
            out.append(s)
    # stable: each group keeps the engine's sample order (free auto replies before explored ones)
    out.sort(key=lambda s: (s.group, s.metadata.get("autothink_forced") is not None))
    return out


def role_of(sample: RolloutSample) -> str:
    """The linked-group role of a sample (replay rows inherit it from their group's id)."""
    role = sample.metadata.get("autothink_role")
    return role if role is not None else ROLES[sample.group % len(ROLES)]


def _reply(s: RolloutSample) -> Reply:
    base = s.metadata.get("autothink_base_reward", s.reward)
    return Reply(s.text, s.num_tokens, bool(s.passed), float(base or 0.0), s.valid, s.source == "rollout")


def link_groups(samples: Sequence[RolloutSample], n_questions: int, cfg: AutoThinkConfig,
                length_scale: int) -> list[list[RolloutSample]]:
    """Group scored samples (ids from :func:`generate`, replay rows appended) into one linked list per
    question, apply :func:`mode_selection_rewards` to its auto replies (``reward`` replaced; the ordinary
    reward kept in ``metadata["autothink_base_reward"]``, the score in ``metadata["autothink"]``) and
    return the per-question lists (auto, then think, then direct members).

    Raises:
        KeyeInputError: an unscored valid sample or a group id beyond ``n_questions``.
    """
    linked: list[list[RolloutSample]] = [[] for _ in range(n_questions)]
    for i, s in enumerate(samples):
        q = s.group // len(ROLES)
        if not 0 <= q < n_questions:
            raise KeyeInputError(f"autothink: group id {s.group} is not one of {n_questions} questions' groups", item=i)
        if s.valid and s.reward is None:
            raise KeyeInputError("autothink: sample has no reward; score the samples first", item=i)
        s.metadata.setdefault("autothink_role", role_of(s))
        linked[q].append(s)
    for members in linked:
        members.sort(key=lambda s: ROLES.index(role_of(s)))  # stable
        by_role = {role: [s for s in members if role_of(s) == role] for role in ROLES}
        res = mode_selection_rewards(*(([_reply(s) for s in by_role[role]]) for role in ROLES), cfg,
                                     length_scale=length_scale)
        info = {"p_think": res.p_think, "p_direct": res.p_direct, "n_think": res.n_think,
                "n_direct": res.n_direct, "prefer": res.prefer}
        for s in members:
            s.metadata["autothink_question"] = info
        for s, sc in zip(by_role["auto"], res.auto):
            if not s.valid:
                continue
            s.metadata.setdefault("autothink_base_reward", float(s.reward))
            s.reward = sc.reward
            s.metadata["autothink"] = dataclasses.asdict(sc)
    return linked


def group_signal(linked: Sequence[RolloutSample], metric: str, train_forced: bool) -> list[float]:
    """What dynamic sampling compares for one linked question: the values of its first informative trained
    group (auto first; think and direct too with ``train_forced``), else the auto group's (all equal: the
    question is dropped). The auto group is always compared on its reward (the mode-selection reward differs
    between correct replies of different modes); forced groups on ``metric`` (see
    :func:`keye.rl.algorithms.sampling.group_signal`)."""
    from keye.rl.algorithms.sampling import group_signal as plain_signal
    from keye.rl.algorithms.sampling import is_informative

    roles = ROLES if train_forced else ROLES[:1]
    first: list[float] | None = None
    for role in roles:
        members = [s for s in linked if role_of(s) == role]
        vals = plain_signal(members, "reward" if role == "auto" else metric)
        if first is None:
            first = vals
        if is_informative(vals):
            return vals
    return first or []


def flatten(linked_groups: Sequence[Sequence[RolloutSample]], train_forced: bool) -> tuple[list[RolloutSample], int]:
    """The training batch of the kept linked questions: samples renumbered to consecutive group ids, one per
    (question, role), forced roles dropped unless ``train_forced``. Returns (samples, number of groups)."""
    out: list[RolloutSample] = []
    n = 0
    for members in linked_groups:
        for role in ROLES if train_forced else ROLES[:1]:
            rows = [s for s in members if role_of(s) == role]
            if not rows:
                continue
            for s in rows:
                s.group = n
                out.append(s)
            n += 1
    return out, n


# ------------------------------------------------------------------------------------------ measuring
def metric_sums(linked_groups: Sequence[Sequence[RolloutSample]]) -> dict[str, float]:
    """Sums and counts over this rank's kept linked questions (add them over ranks, then
    :func:`finish_metrics`). Only fresh valid replies count."""
    keys = ("n_auto", "think", "passed", "tokens", "reward", "well_formed", "n_pref", "match", "q", "q_pt", "pt",
            "q_pd", "pd", "q_pref", "prefer_direct", "n_ft", "ft_passed", "ft_tokens", "n_fd", "fd_passed",
            "fd_tokens", "n_free", "free_think")
    sums = dict.fromkeys(keys, 0.0)
    for members in linked_groups:
        if not members:
            continue
        q = members[0].metadata.get("autothink_question", {})
        sums["q"] += 1
        if q.get("p_think") is not None:
            sums["q_pt"] += 1
            sums["pt"] += q["p_think"]
        if q.get("p_direct") is not None:
            sums["q_pd"] += 1
            sums["pd"] += q["p_direct"]
        if q.get("prefer") is not None:
            sums["q_pref"] += 1
            sums["prefer_direct"] += q["prefer"] == "direct"
        for s in members:
            if not (s.valid and s.source == "rollout"):
                continue
            role = role_of(s)
            if role == "auto":
                sc = s.metadata.get("autothink", {})
                sums["n_auto"] += 1
                sums["think"] += sc.get("decision") == "think"
                sums["passed"] += bool(s.passed)
                sums["tokens"] += s.num_tokens
                sums["reward"] += float(s.reward)
                sums["well_formed"] += bool(sc.get("well_formed"))
                if s.metadata.get("autothink_forced") is None:  # a decision the policy took itself
                    sums["n_free"] += 1
                    sums["free_think"] += sc.get("decision") == "think"
                if q.get("prefer") is not None:
                    sums["n_pref"] += 1
                    sums["match"] += sc.get("decision") == q["prefer"]
            else:
                k = "ft" if role == "think" else "fd"
                sums[f"n_{k}"] += 1
                sums[f"{k}_passed"] += bool(s.passed)
                sums[f"{k}_tokens"] += s.num_tokens
    return sums


def finish_metrics(g: dict[str, float], prefix: str = "autothink/") -> dict[str, float]:
    """Step metrics from (all-rank) :func:`metric_sums`: ``think_rate``, ``auto_accuracy``,
    ``mean_reply_tokens``, ``reward``, ``format_ok`` over fresh auto replies; ``p_think`` / ``p_direct``
    (mean over questions of the estimates the reward used), ``prefer_direct`` (share of questions),
    ``mode_match`` (share of auto replies that chose the preferred mode), ``forced_think_accuracy`` /
    ``forced_direct_accuracy`` and ``forced_*_tokens``; ``free_think_rate``: the think rate of the auto replies whose
    decision was not forced by ``explore`` (the policy's own). A metric without any reply or question is left out."""

    def div(a: str, b: str) -> float | None:
        return g[a] / g[b] if g[b] else None

    vals = {
        "think_rate": div("think", "n_auto"), "auto_accuracy": div("passed", "n_auto"),
        "mean_reply_tokens": div("tokens", "n_auto"), "reward": div("reward", "n_auto"),
        "format_ok": div("well_formed", "n_auto"), "mode_match": div("match", "n_pref"),
        "p_think": div("pt", "q_pt"), "p_direct": div("pd", "q_pd"), "prefer_direct": div("prefer_direct", "q_pref"),
        "forced_think_accuracy": div("ft_passed", "n_ft"), "forced_think_tokens": div("ft_tokens", "n_ft"),
        "forced_direct_accuracy": div("fd_passed", "n_fd"), "forced_direct_tokens": div("fd_tokens", "n_fd"),
        "free_think_rate": div("free_think", "n_free"),
    }
    return {f"{prefix}{k}": float(v) for k, v in vals.items() if v is not None}


def question_records(linked_groups: Sequence[Sequence[RolloutSample]], step: int) -> list[dict[str, Any]]:
    """One JSON-able row per linked question: step, question id, the reward's estimates and preference, and
    per role every reply (text, prompt mode, tokens, passed, base reward, final reward, valid, source). Feeding a row's
    replies back through :func:`mode_selection_rewards` reproduces its auto rewards (:func:`replies_of`)."""
    rows = []
    for members in linked_groups:
        if not members:
            continue
        q = members[0].metadata.get("autothink_question", {})
        row: dict[str, Any] = {"step": step, "question": members[0].prompt.id, **q, "groups": {}}
        for role in ROLES:
            row["groups"][role] = [
                {"text": s.text, "mode": s.prompt.mode, "tokens": s.num_tokens, "passed": bool(s.passed), "valid": s.valid,
                 "source": s.source, "forced": s.metadata.get("autothink_forced"),
                 "base_reward": float(s.metadata.get("autothink_base_reward", s.reward or 0.0)),
                 "reward": float(s.reward or 0.0)}
                for s in members if role_of(s) == role]
        rows.append(row)
    return rows


def replies_of(row: dict[str, Any], role: str) -> list[Reply]:
    """The :class:`Reply` list of ``role`` in a :func:`question_records` row."""
    return [Reply(r["text"], int(r["tokens"]), bool(r["passed"]), float(r["base_reward"]), bool(r["valid"]),
                  r["source"] == "rollout") for r in row["groups"][role]]


class GroupLog:
    """``<out_dir>/autothink_groups.jsonl``, appended once per step on the main rank. Opening it with
    ``resume_step`` drops the rows of steps after that checkpoint (a resumed run redoes them), so the file
    of a resumed run equals the uninterrupted run's."""

    NAME = "autothink_groups.jsonl"

    def __init__(self, out_dir: str | Path, resume_step: int, enabled: bool = True):
        self.path = Path(out_dir) / self.NAME
        self.enabled = enabled
        if not enabled:
            return
        if self.path.exists():
            kept = []
            for n, line in enumerate(self.path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    step = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError) as err:
                    raise KeyeInputError(f"unreadable row ({err})", path=self.path, item=n) from None
                if step <= resume_step:
                    kept.append(line + "\n")
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(self.path)

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        """Append ``rows`` (no-op when disabled)."""
        if not self.enabled or not rows:
            return
        with open(self.path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The rows of an ``autothink_groups.jsonl``."""
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


__all__ = ["AutoReplyScore", "AutoThinkConfig", "GroupLog", "QuestionRewards", "ROLES", "ROLE_MODES", "Reply",
           "break_even_edge", "decision_of", "expand", "expected_decision_gap", "finish_metrics", "flatten", "generate", "group_id", "group_signal",
           "is_well_formed_auto", "link_groups", "metric_sums", "mode_selection_rewards", "question_records",
           "read_records", "replies_of", "role_of"]
