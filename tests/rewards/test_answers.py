"""The answer-format helpers' one home (keye.rewards.text / format / answers) and the names re-exported from
where they used to live."""

from __future__ import annotations

import pytest

from keye.errors import KeyeInputError
from keye.rewards.format import has_valid_boxed, mode_from_prompt, mode_suffix, split_mode_switch
from keye.rewards.text import closing_brace, extract_boxed, final_answer, last_boxed


@pytest.mark.parametrize("text, expected", [
    ("a}", 1), ("a{b}c}", 5), ("{{}}", -1), ("", -1), ("}}", 0),
])
def test_closing_brace(text: str, expected: int) -> None:
    assert closing_brace(text) == expected


def test_closing_brace_stops_at_end() -> None:
    assert closing_brace("ab}", 0, 2) == -1
    assert closing_brace("x{a}b}", 2) == 3
    assert closing_brace("x{a}b}", 4) == 5


@pytest.mark.parametrize("text, strict, keyechat", [
    ("x \\boxed{a{b}c} y", "a{b}c", "a{b}c"),
    ("\\boxed{1} then \\boxed{2", "1", "2"),  # strict falls back to the earlier closed box
    ("\\boxed{1}\\boxed{2}", "2", "2"),
    ("plain", None, "plain"),
    ("f(x)} = 3", None, "f(x)"),
    ("\\boxed{}", "", ""),
    ("\\boxed{a} \\boxed{b {c}", "a", "b {c}"),  # nested braces keep the last box open
])
def test_last_boxed_and_keyechat_boxed(text: str, strict: str | None, keyechat: str) -> None:
    assert last_boxed(text) == strict
    assert extract_boxed(text) == keyechat


def test_last_boxed_is_linear_on_many_unclosed_boxes() -> None:
    text = "\\boxed{1}" + "\\boxed{" * 200_000
    assert last_boxed(text) == "1"  # quadratic scanning would take minutes here


def test_has_valid_boxed() -> None:
    assert has_valid_boxed("so \\boxed{ 3 }")
    assert not has_valid_boxed("\\boxed{ }")
    assert not has_valid_boxed("\\boxed{3")
    assert not has_valid_boxed("3")


@pytest.mark.parametrize("text, rest, mode", [
    ("Q/think", "Q", "think"),
    ("Q /no_think \n", "Q", "no_think"),
    ("Q/think/no_think", "Q/think", "no_think"),
    ("Q", "Q", None),
    ("Q  ", "Q  ", None),  # text without a switch comes back as it was
    ("Q x_think", "Q x_think", None),
])
def test_split_mode_switch(text: str, rest: str, mode: str | None) -> None:
    assert split_mode_switch(text) == (rest, mode)
    assert mode_from_prompt(text) == (mode or "auto")


def test_mode_suffix() -> None:
    assert [mode_suffix(m) for m in (None, "auto", "think", "no_think")] == ["", "", "/think", "/no_think"]
    for bad in ("deep", "/think", ["think"]):
        with pytest.raises(KeyeInputError, match="unknown thinking mode"):
            mode_suffix(bad)  # type: ignore[arg-type]


def test_old_homes_re_export_the_one_implementation() -> None:
    from keye.eval import extract as eval_extract
    from keye.eval import keyechat
    from keye.processing import chat
    from keye.rewards import answers

    assert keyechat.extract_boxed is extract_boxed
    assert keyechat.mode_suffix is mode_suffix
    assert chat.extract_boxed is last_boxed
    assert eval_extract.choice_letter is answers.choice_letter
    assert keyechat.post_process("<think>t</think>\\boxed{7}") == final_answer("<think>t</think>\\boxed{7}") == "7"
