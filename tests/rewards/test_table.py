"""Table-driven reward tests: each case states the rule it checks (from ``docs/training.md`` §1.3/§2.5/§2.6/§8,
``docs/evaluation.md`` §1.3/§2.4/§3, and the rules in the ``keye.rewards`` module docstrings) and the expected
value derived by hand from that rule."""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

from keye.rewards import RewardSpec, final_answer, score

ALL_PARTS = dict(format=1.0, accuracy=1.0, json=1.0, code=1.0, markdown=1.0, steps=1.0, length=1.0,
                 repetition=1.0, overlong=1.0)
CHOICES = ["nucleus", "mitochondria", "ribosome", "golgi apparatus"]


class Case(NamedTuple):
    rule: str
    response: str
    kwargs: dict[str, Any]
    part: str
    expected: float | None  # None: the part must not apply (absent from parts)
    options: dict[str, Any] = {}


def mc(response: str, expected: float, rule: str, reference: Any = "B", **options: Any) -> Case:
    return Case(rule, response, {"reference": reference, "task": "mc", "choices": CHOICES}, "accuracy",
                expected, options)


def acc(response: str, reference: Any, task: str, expected: float, rule: str, **kw: Any) -> Case:
    return Case(rule, response, {"reference": reference, "task": task, **kw}, "accuracy", expected)


def fmt(response: str, mode: str | None, expected: float, rule: str, **options: Any) -> Case:
    return Case(rule, response, {"mode": mode}, "format", expected, options)


def inst(response: str, instructions: dict, part: str, expected: float | None, rule: str) -> Case:
    return Case(rule, response, {"instructions": instructions}, part, expected)


LOOP = " ".join(f"w{i}" for i in range(40)) + " " + " ".join(["the end"] * 30)
LINES = "This is line alpha\nThis is line beta\nThis is line alpha\nThis is line alpha\nThis is line gamma"

CASES = [
    # ---------------- format: thinking modes (training.md §2.5 alignment RL, §8.9; format module rules) -------
    fmt("<think>reason</think>\nanswer", "think", 1.0, "think: a non-empty think block then the answer"),
    fmt("answer only", "think", 0.0, "think mode requires a think block"),
    fmt("<think>   </think>answer", "think", 0.0, "an empty think block is not thinking"),
    fmt("direct answer", "no_think", 1.0, "no_think: no think block"),
    fmt("<think>r</think>answer", "no_think", 0.0, "no_think forbids a non-empty think block"),
    fmt("<think>\n\n</think>\n\nanswer", "no_think", 1.0, "Qwen3's empty think block is accepted in no_think"),
    fmt("<think>\n\n</think>\n\nanswer", "no_think", 0.0, "...unless allow_empty_think_in_no_think=False",
        allow_empty_think_in_no_think=False),
    fmt("<analysis>hard, so /think</analysis><think>r</think>ans", "auto", 1.0,
        "auto: analysis first, then the mode it chose"),
    fmt("<analysis>easy. /no_think</analysis>ans", "auto", 1.0, "auto: analysis then a direct answer"),
    fmt("<analysis>easy. /no_think</analysis><think>r</think>ans", "auto", 0.0,
        "auto: analysis chose /no_think but the response thinks"),
    fmt("<think>r</think>ans", "auto", 0.0, "auto requires the analysis block by default"),
    fmt("<think>r</think>ans", "auto", 1.0, "...unless auto_requires_analysis=False", auto_requires_analysis=False),
    fmt("<analysis>x</analysis>ans", "think", 0.0, "no analysis block in a forced mode"),
    fmt("<think>r</think>", None, 0.0, "an answer must follow the reasoning"),
    fmt("<think>r</think><think>s</think>ans", None, 0.0, "each tag at most once"),
    fmt("<think>r ans", None, 0.0, "every opened tag is closed"),
    fmt("ans <think>r</think>", None, 0.0, "the think block opens the response"),
    fmt("</think>ans<think>", None, 0.0, "tags in order (close before open is malformed)"),
    fmt("<think>r</think><answer>B</answer> extra", None, 0.0, "nothing after </answer>"),
    fmt("<think>r</think>So: <answer>B</answer>\n", None, 1.0, "text before <answer> and trailing space are fine"),
    fmt("<think>r</think><answer> </answer>", None, 0.0, "the answer block is non-empty"),
    fmt("<think>r</think>ans </think", None, 0.0, "a broken stray tag is malformed"),
    fmt("", None, 0.0, "an empty response has no answer"),
    fmt("<think>r</think>B<|im_end|>\n<|endoftext|>", "think", 1.0, "trailing EOS markers are not answer text"),
    fmt("<think>r</think>B", None, 0.0, "require_answer_tag needs <answer>", require_answer_tag=True),
    fmt("<think>r</think>so \\boxed{12}", None, 1.0, "require_boxed: balanced non-empty box", require_boxed=True),
    fmt("<think>r</think>so \\boxed{12", None, 0.0, "require_boxed: unbalanced box fails", require_boxed=True),
    fmt("<think>r</think>so \\boxed{}", None, 0.0, "require_boxed: empty box fails", require_boxed=True),
    Case("mode from the prompt suffix /no_think (evaluation.md §3)", "<think>r</think>a",
         {"prompt": "What is shown?/no_think"}, "format", 0.0),
    Case("mode from the prompt suffix /think", "<think>r</think>a", {"prompt": "Why?/think"}, "format", 1.0),
    # ---------------- accuracy: multiple choice (evaluation.md §1.3 / §2.4 / VLMEvalKit can_infer) -----------
    mc("(B)", 1.0, "bracketed letter"),
    mc("B.", 1.0, "letter with a trailing period"),
    mc("**B**", 1.0, "markdown-bold letter"),
    mc("B\n", 1.0, "raw decode with a newline"),
    mc("Answer: B", 1.0, "'Answer:' phrase"),
    mc("The answer is B, not C", 1.0, "the answer phrase wins over a later letter token"),
    mc("The answer is (b)", 0.0, "letters are uppercase only"),
    mc("B. mitochondria", 1.0, "leading letter with a delimiter"),
    mc("mitochondria", 1.0, "the option text itself"),
    mc("The correct option is the mitochondria because it produces ATP", 1.0, "exactly one option text inside"),
    mc("I think (A) is wrong, the answer is (C)", 0.0, "the last answer phrase decides (C)"),
    mc("A cat is shown so D", 0.0, "two letter tokens and no option text: unparsed"),
    mc("B", 1.0, "a gold option text maps to its letter", reference="mitochondria"),
    mc("<think>maybe A</think>\n<answer>B</answer>", 1.0, "KeyeChat: the answer after the think block"),
    mc("<think>I think \\boxed{B}</think>\nFinal: C", 0.0, "boxes inside the think block are discarded"),
    mc("C", -1.0, "accuracy_pm1: a wrong answer scores -1 (RLEP ±1 verifier)", accuracy_pm1=True),
    mc("B", 1.0, "accuracy_pm1: a right answer scores +1", accuracy_pm1=True),
    # ---------------- accuracy: numbers (evaluation.md §1.4 / §2.4) ------------------------------------------
    acc("\\boxed{12}", "12", "numeric", 1.0, "boxed integer"),
    acc("The answer is 12.0", 12, "numeric", 1.0, "12.0 equals 12 as a number"),
    acc("2,000,000", "2000000", "numeric", 1.0, "thousands separators"),
    acc("36 watts", "30", "numeric", 0.0, "units are ignored, the number differs"),
    acc("\u2212120", "-120", "numeric", 1.0, "a Unicode minus is a minus"),
    acc("The value is 5. The final answer is 7", "5", "numeric", 0.0, "the last number is the answer"),
    acc("\\frac{1}{2}", 0.5, "numeric", 1.0, "LaTeX fraction"),
    acc("3/4", 0.75, "numeric", 1.0, "plain fraction"),
    acc("50%", 0.5, "numeric", 1.0, "percent on one side matches value/100"),
    acc("1.25", "1.2", "numeric", 1.0, "precision 1: round(1.25, 1) == 1.2 (MathVista float rule)", precision=1),
    acc("2.675", "2.68", "numeric", 0.0, "precision 2: binary rounding gives 2.67", precision=2),
    acc("3.1416", 3.14159, "numeric", 0.0, "default relative tolerance 1e-6"),
    acc("3.1416", 3.14159, "numeric", 1.0, "absolute tolerance 0.01", tolerance=0.01),
    acc("no number here", 3, "numeric", 0.0, "no number -> wrong"),
    acc("1e3", 1000, "numeric", 1.0, "scientific notation"),
    acc("between 3-5", "5", "numeric", 1.0, "a '-' glued to a digit is a hyphen, so the last number is 5"),
    acc("x = -\\frac{1}{2}", -0.5, "numeric", 1.0, "a sign before \\frac applies to the fraction"),
    acc("-\\frac{1}{2}", "\\frac{1}{2}", "math", 0.0, "number fast path keeps the sign (no math-verify needed)"),
    # ---------------- accuracy: math equivalence (math-verify) ----------------------------------------------
    acc("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", "math", 1.0, "equal after LaTeX-cosmetic normalisation"),
    acc("0.5", "\\frac{1}{2}", "math", 1.0, "math-verify: numeric value"),
    acc("\\sqrt{8}", "2\\sqrt{2}", "math", 1.0, "math-verify: simplification"),
    acc("(x+1)^2", "x^2+2x+1", "math", 1.0, "math-verify: symbolic expansion"),
    acc("\\frac{1}{3}", "\\frac{1}{2}", "math", 0.0, "different values"),
    acc("x = 3", "3", "math", 1.0, "math-verify unwraps an assignment"),
    acc("<think>a</think>", "1", "math", 0.0, "empty final answer"),
    # ---------------- accuracy: text, list, json -------------------------------------------------------------
    acc("The Eiffel Tower.", "eiffel tower", "text", 1.0, "normalised exact match (case, punctuation, articles)"),
    acc("Paris, France", "Paris", "text", 0.0, "exact match, not substring"),
    acc("florida", ["Tampa", "Florida"], "text", 1.0, "any of several golds (MMMU list golds)"),
    acc("[2014, 2016]", [2014, 2016], "list", 1.0, "list items match in order"),
    acc("2016, 2014", [2014, 2016], "list", 0.0, "order matters by default"),
    acc("2016 and 2014", [2014, 2016], "list", 1.0, "ordered=False ignores order", ordered=False),
    acc("[1, 2]", "[1,2,3]", "list", 0.0, "lengths must agree"),
    acc('{"a": 1, "b": [2]}', {"b": [2], "a": 1}, "json", 1.0, "JSON values compare structurally"),
    Case("no reference: accuracy does not apply", "anything", {"reference": None}, "accuracy", None),
    # ---------------- instruction format (training.md §2.5: JSON, markdown, code, steps, length) ------------
    inst('{"name": "x"}', {"json": True}, "json", 1.0, "a bare JSON object"),
    inst('```json\n{"name": "x"}\n```', {"json": True}, "json", 1.0, "one fenced json block"),
    inst('Here: {"a": 1}', {"json": True}, "json", 0.0, "text around the JSON"),
    inst('{"age": "3"}', {"json": True, "json_schema": {"type": "object", "properties": {"age": {"type": "integer"}},
                                                         "required": ["age"]}}, "json", 0.0, "schema violation"),
    inst("[1, 2", {"json": True}, "json", 0.0, "truncated JSON"),
    inst("12", {"json": True}, "json", 0.0, "a bare scalar is not a JSON object/array"),
    inst("```python\nprint(1)\n```", {"code_language": "python"}, "code", 1.0, "python block that parses"),
    inst("```py\ndef f(:\n```", {"code_language": "python"}, "code", 0.0, "python block with a syntax error"),
    inst("```js\nx = 1\n```", {"code_language": "python"}, "code", 0.0, "wrong language"),
    inst("```python\nprint(1)", {"code_language": "python"}, "code", 0.0, "unclosed fence"),
    inst("- a\n- b", {"markdown": "list"}, "markdown", 1.0, "two list items"),
    inst("- a only", {"markdown": "list"}, "markdown", 0.0, "one item is not a list"),
    inst("| a | b |\n|---|:-:|\n| 1 | 2 |", {"markdown": "table"}, "markdown", 1.0, "header, separator, row"),
    inst("| a | b |\n| 1 | 2 |", {"markdown": "table"}, "markdown", 0.0, "a table needs a separator row"),
    inst("<think>Step 1: a\nStep 2: b\nStep 3: c</think>ans", {"steps": [3, 5]}, "steps", 1.0, "3 steps in [3, 5]"),
    inst("<think>1. a\n2. b</think>ans", {"steps": 3}, "steps", 0.0, "2 steps, at least 3 wanted"),
    inst("one two three four", {"length": [3, 5]}, "length", 1.0, "4 words in [3, 5]"),
    inst("one", {"length": [3, 5]}, "length", 0.0, "1 word below the window"),
    inst("one", {"length": True}, "length", 1.0, "True: the spec's window [0, unbounded]"),
    inst('{"a": 1}', {"json": {"type": "array"}}, "json", 0.0, "a schema given as the json value applies"),
    inst("我爱你", {"length": [3, 3]}, "length", 1.0, "each CJK character is one word"),
    inst('{"a": 1}', {"markdown": "list"}, "json", None, "instructions that do not ask for JSON: part absent"),
    # ---------------- repetition (training.md §2.3 II.3 rule-based repetition score) -------------------------
    Case("short text: below the minimum token count", "A short, normal answer.", {}, "repetition", 0.0),
    Case("a response that is one loop scores -1", "ha " * 100, {}, "repetition", -1.0),
    Case("trailing loop of 60 of 100 tokens: -0.6 (beats n-gram penalty 0.509)", LOOP, {}, "repetition", -0.6),
    Case("2 of 5 long lines repeated: -(0.4 - 0.1) / 0.9", LINES, {}, "repetition", -1 / 3),
    # ---------------- overlong, DAPO (training.md §1.3 step 10: L_max 3072, L_buf 512) -------------------------
    Case("L <= L_max - L_buf: no penalty", "x", {"num_tokens": 2560}, "overlong", 0.0),
    Case("halfway into the buffer: -0.5", "x", {"num_tokens": 2816}, "overlong", -0.5),
    Case("at L_max: -1", "x", {"num_tokens": 3072}, "overlong", -1.0),
    Case("beyond L_max: clipped at -1", "x", {"num_tokens": 5000}, "overlong", -1.0),
    Case("no num_tokens: ceil(chars / 4) estimate, 11264 chars = 2816 tokens", "abcd " * 2252 + "abcd",
         {}, "overlong", -0.5),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{i:03d}-{c.part}-{c.rule[:40]}" for i, c in enumerate(CASES)])
def test_rule(case: Case) -> None:
    spec = RewardSpec(**{**ALL_PARTS, **case.options})
    result = score(case.response, spec=spec, **case.kwargs)
    if case.expected is None:
        assert case.part not in result.parts, case.rule
    else:
        assert result.parts[case.part] == pytest.approx(case.expected, abs=1e-9), (case.rule, result)


def test_table_size() -> None:
    assert len(CASES) >= 60


# KeyeChat post-processing, evaluation.md §3 table (rows 1-10, verbatim).
KEYECHAT = [
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
]


@pytest.mark.parametrize("raw,expected", KEYECHAT)
def test_keyechat_final_answer(raw: str, expected: str) -> None:
    assert final_answer(raw) == expected


def test_weighted_total() -> None:
    # total = sum(weight * part): 0.5 * format(1) + 2.0 * accuracy(1) = 2.5
    r = score("<think>r</think>\\boxed{4}", reference="4", task="numeric", mode="think",
              spec=RewardSpec(format=0.5, accuracy=2.0))
    assert r.parts == {"format": 1.0, "accuracy": 1.0}
    assert r.total == pytest.approx(2.5)


NATURAL = {
    "math CoT": (
        "<think>\nThe square has side length 4, so its area is 4 * 4 = 16.\n"
        "The circle inside the square has radius 2, so its area is pi * 2^2 = 4 pi.\n"
        "The shaded region is the part of the square outside the circle, so the area is 16 - 4 pi.\n"
        "Let me double-check: the side length is 4 because the grid shows 4 unit squares along each edge.\n"
        "The radius is 2 because the circle touches all four sides, so the diameter equals the side length.\n"
        "Therefore the shaded area is 16 - 4 pi, which is about 16 - 12.566 = 3.434.\n"
        "Looking at the options: (A) 16 - 2 pi, (B) 16 - 4 pi, (C) 8 - pi, (D) 4 pi.\n</think>\n<answer>B</answer>"
    ),
    "table": "| Year | Revenue | Profit |\n|---|---|---|\n| 2019 | 10 | 1 |\n| 2020 | 12 | 2 |\n| 2021 | 15 | 3 |",
    "code": "```python\ndef f(x):\n    return x + 1\n\n\ndef g(x):\n    return x + 1\n\n\nprint(f(1))\nprint(g(1))\n```",
    "numbered steps": "\n".join(f"Step {i}: compute x_{i} = x_{i - 1} + 2 = {2 * i}." for i in range(1, 15)),
}


@pytest.mark.parametrize("name", list(NATURAL))
def test_natural_text_is_not_penalised(name: str) -> None:
    # Rule: repetition penalises only repetition beyond the 10% threshold, trailing loops of >= 4 copies, and
    # repeats of long lines; ordinary reasoning, tables, short repeated code lines and step lists stay at 0.
    assert score(NATURAL[name], spec=RewardSpec(format=0.0, accuracy=0.0, repetition=1.0)).parts["repetition"] == 0.0
