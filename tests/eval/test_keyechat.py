"""Keye's response post-processing and thinking-mode switches (docs/evaluation.md section 3)."""

from __future__ import annotations

import pytest

from keye.errors import KeyeInputError
from keye.eval.keyechat import add_mode_suffix, extract_boxed, mode_suffix, post_process

# The table of docs/evaluation.md section 3, plus cases derived from the same rules.
POST_PROCESS_CASES = [
    ("<think>long reasoning</think>\n\n<answer>B</answer>", "B"),
    ("<think>x</think>\nThe answer is \\boxed{12}.", "12"),
    ("<think>x</think><answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
    ("<think>x</think>\n<answer>A</answer> then <answer>C</answer>", "C"),
    ("<think>unterminated reasoning ... \\boxed{7", "7"),
    ("\\boxed{A} and later \\boxed{B}", "B"),
    ("<think>I think \\boxed{3}</think>\nFinal: 4", "Final: 4"),
    ("<answer>B", "<answer>B"),
    ("f(x)} = 3", "f(x)"),
    ("no tags, answer C", "no tags, answer C"),
    # auto mode: the analysis preamble is cut, then the think block.
    ("<analysis>easy, so /no_think</analysis>B", "B"),
    ("<analysis>hard</analysis><think>work</think>\n\n  D  ", "D"),
    # without </think> nothing is trimmed
    ("  C\n", "  C\n"),
    # the answer tag spans newlines (dot matches newline)
    ("<think>t</think><answer>line1\nline2</answer>", "line1\nline2"),
    # several think blocks: the text after the last one
    ("<think>a</think>x<think>b</think>\n\ny", "y"),
]


@pytest.mark.parametrize("raw, expected", POST_PROCESS_CASES)
def test_post_process(raw: str, expected: str) -> None:
    assert post_process(raw) == expected


def test_post_process_rejects_non_strings() -> None:
    with pytest.raises(KeyeInputError):
        post_process(None)  # type: ignore[arg-type]


def test_extract_boxed_nested_and_unclosed() -> None:
    assert extract_boxed("x \\boxed{a{b}c} y") == "a{b}c"
    assert extract_boxed("\\boxed{a{b") == "a{b"
    assert extract_boxed("plain") == "plain"


def test_mode_suffix_appends_to_last_user_text() -> None:
    conv = [
        {"role": "user", "content": [{"type": "text", "text": "first"}]},
        {"role": "assistant", "content": "ok"},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": "x.png"},
                {"type": "text", "text": "Q?"},
                {"type": "image", "image": "y.png"},
            ],
        },
    ]
    out = add_mode_suffix(conv, "think")
    assert out[2]["content"][1]["text"] == "Q?/think"
    assert out[0]["content"][0]["text"] == "first"
    assert conv[2]["content"][1]["text"] == "Q?"  # the input is not modified
    assert add_mode_suffix([{"role": "user", "content": "Q"}], "no_think")[0]["content"] == "Q/no_think"
    assert add_mode_suffix([{"role": "user", "content": "Q"}], "auto")[0]["content"] == "Q"
    only_media = add_mode_suffix(
        [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}], "think"
    )
    assert only_media[0]["content"][-1] == {"type": "text", "text": "/think"}


def test_mode_errors() -> None:
    assert mode_suffix(None) == ""
    with pytest.raises(KeyeInputError):
        mode_suffix("deep")
    with pytest.raises(KeyeInputError):
        add_mode_suffix([{"role": "assistant", "content": "x"}], "think")
