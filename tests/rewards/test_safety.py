"""Safety under bad input: random and adversarial strings give finite rewards in the documented ranges,
within a time limit, without raising (issue scope item 6)."""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keye.rewards import RewardSpec, get_reward, score

# Every built-in part on, math with a short hard limit so a pathological expression cannot stall the suite.
SPEC = RewardSpec(format=1.0, accuracy=1.0, json=1.0, code=1.0, markdown=1.0, steps=1.0, length=1.0,
                  repetition=1.0, overlong=1.0, math_timeout_s=1.0, length_max=50, steps_max=9)
SPEC_PM1 = RewardSpec(format=1.0, accuracy=1.0, repetition=1.0, overlong=1.0, accuracy_pm1=True, math_timeout_s=1.0)
TASKS = [("numeric", "12"), ("mc", "B"), ("math", "\\frac{1}{2}"), ("text", "paris"), ("list", [1, 2]),
         ("json", {"a": 1}), (None, None)]
MODES = ["think", "no_think", "auto", None]
TIME_LIMIT_S = 1.0 + 4.0  # math hard limit + generous slack for a loaded 2-core machine

# Fragments that drive the parsers into their interesting states.
FRAGMENTS = [
    "<think>", "</think>", "<analysis>", "</analysis>", "<answer>", "</answer>", "</think", "<answer ",
    "\\boxed{", "{", "}", "\\frac{", "\\sqrt{", "^{", "$", "```", "```python\n", "```json\n", "\n", " ", "|", "---",
    "- ", "1. ", "Step 2:", "/think", "/no_think", "Answer: ", "(B)", "**C**", "12", "-3.5", "1,000", "%", "/", "e9",
    "\u2212", "[", "]", '{"a": 1}', ",", "and", "\x00", "\ud800", "\u202e", "我", "😀", "\\left(", "\\right)",
]

fuzz_text = st.one_of(
    st.text(max_size=400),
    st.text(alphabet=st.characters(codec=None), max_size=200),  # includes lone surrogates and controls
    st.lists(st.sampled_from(FRAGMENTS), max_size=60).map("".join),
    st.binary(max_size=200),  # bytes are decoded with replacement
)


def _check(result, spec: RewardSpec) -> None:
    assert math.isfinite(result.total)
    for name, value in result.parts.items():
        info = get_reward(name)
        assert math.isfinite(value) and info.low <= value <= info.high, (name, value)
    if "accuracy" in result.parts:
        allowed = {-1.0, 1.0} if spec.accuracy_pm1 else {0.0, 1.0}
        assert result.parts["accuracy"] in allowed
    for name in ("format", "json", "code", "markdown", "steps", "length"):
        if name in result.parts:
            assert result.parts[name] in (0.0, 1.0)
    bound = sum(abs(w) for w in spec.weights().values())
    assert abs(result.total) <= bound + 1e-9


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=fuzz_text, task=st.sampled_from(TASKS), mode=st.sampled_from(MODES), pm1=st.booleans())
def test_fuzz_finite_in_range_and_fast(text, task, mode, pm1) -> None:
    spec = SPEC_PM1 if pm1 else SPEC
    t0 = time.perf_counter()
    result = score(text, reference=task[1], task=task[0], mode=mode, spec=spec, choices=["a", "b", "c"])
    assert time.perf_counter() - t0 < TIME_LIMIT_S
    _check(result, spec)


ADVERSARIAL = {
    "empty": "",
    "5MB plain": "a" * 5_000_000,
    "1MB of think tags": "<think>" * 150_000,
    "unclosed answers": "<answer>" * 200_000,
    "closed answers": "<answer>x</answer>" * 60_000,
    "deep braces": "{" * 500_000,
    "deep brackets json": "[" * 200_000 + "]" * 200_000,
    "deep python": "```python\n" + "(" * 100_000 + ")" * 100_000 + "\n```",
    "boxed chain": "\\boxed{" * 200_000,
    "digits": "1" * 1_000_000,
    "comma digits": "1," * 500_000,
    "nul bytes": "\x00" * 100_000 + "<think>\x00</think>\x00",
    "surrogates": "\ud800\udfff" * 50_000,
    "rtl and emoji": "\u202e😀我" * 100_000,
    "newlines": "\n" * 1_000_000,
    "pipes": "|" * 1_000_000,
    "list items": "- a\n" * 200_000,
    "fences": "```\n" * 200_000,
    "answer phrases": "answer is " * 200_000,
    "regex bait": "a" * 50_000 + "!" + "answer: " * 50_000 + "(" * 50_000,
    "fraction bait": "\\frac{" * 100_000 + "1/" * 100_000,
    "loop": "the same line again\n" * 100_000,
    "eos markers": "<|im_end|>\n" * 200_000,
    "huge power": "<think>x</think>\\boxed{9^{9^{9^{9^{9}}}}}",
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
@pytest.mark.parametrize("task,reference", [("math", "1"), ("mc", "A"), ("numeric", "3"), ("list", "[1]")])
def test_adversarial(name: str, task: str, reference: str) -> None:
    text = ADVERSARIAL[name]
    t0 = time.perf_counter()
    result = score(text, reference=reference, task=task, mode="think", spec=SPEC)
    elapsed = time.perf_counter() - t0
    _check(result, SPEC)
    assert elapsed < TIME_LIMIT_S, f"{name}/{task} took {elapsed:.2f}s"


def test_non_string_responses() -> None:
    # None counts as "", bytes are decoded; neither raises.
    assert score(None, reference="1", task="numeric").parts["accuracy"] == 0.0
    assert score(b"\\boxed{1}\xff", reference="1", task="numeric").parts["accuracy"] == 1.0


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(st.lists(st.sampled_from(FRAGMENTS), max_size=20).map("".join), min_size=1, max_size=8),
       mode=st.sampled_from(MODES))
def test_batch_matches_single_and_stats_stay_in_range(texts, mode) -> None:
    from keye.rewards import aggregate_stats, score_batch

    refs = ["12"] * len(texts)
    batch = score_batch(texts, refs, tasks="numeric", modes=mode, spec=SPEC)
    assert [r.as_dict() for r in batch] == [score(t, "12", "numeric", mode, SPEC).as_dict() for t in texts]
    stats = aggregate_stats(batch)
    for name in ("format", "accuracy", "repetition", "overlong"):
        info = get_reward(name)
        assert info.low <= stats[f"reward/{name}/mean"] <= info.high
        assert stats[f"reward/{name}/std"] >= 0.0
