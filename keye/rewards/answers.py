"""Rule-based answer extraction: an option letter or a number read from a free-form answer.

These rules are ours (documented, deterministic, no LLM), used by the benchmarks that have no official rule
of their own (``keye.eval``) and by the synthetic set's answer check (:mod:`keye.data.synth_answers`), which
the data pipeline runs too, so they sit in this bottom layer. The official parsers of MMMU, MathVista and
Video-MME live in their own ``keye.eval`` modules.

The *answer tail* of a response is the text after the last answer cue (``answer is``, ``answer:``,
``final answer is``, ``correct option is``, ...; case-insensitive), or the whole trimmed response when
there is no cue.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_CUE_RE = re.compile(
    r"(?:final answer|correct answer|the answer|answer|correct option|correct choice)\s*(?:is|:|=)\s*:?\s*",
    re.IGNORECASE,
)
# A letter opening the tail and standing alone: "B", "(B)", "**B**", "B.", "B) text", "B: text". The letter
# must be followed by punctuation or the end, so neither the article "a" nor a capital "A cat ..." is read
# as option A.
_LEADING_LETTER = re.compile(r"^\s*\**\(?([A-Z])\)?\**(?:[.:,)]|\s*$)")
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")
_LETTER_TOKEN = re.compile(r"(?<![A-Za-z0-9])([A-Z])(?![A-Za-z0-9])")
NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|-?\.\d+")
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)")


def answer_tail(text: str) -> str:
    """Return the text after the last answer cue, trimmed (the whole trimmed text without a cue)."""
    matches = list(_CUE_RE.finditer(text))
    return text[matches[-1].end() :].strip() if matches else text.strip()


def leading_letter(text: str, letters: Sequence[str]) -> str | None:
    """Return the option letter opening ``text`` if it is in ``letters``.

    The letter may be bracketed or bold and must be followed by ``.``, ``:``, ``,``, ``)`` or the end:
    ``B``, ``(B) text``, ``**B**``, ``B. text`` match; ``B is right`` and ``A cat`` do not.
    """
    match = _LEADING_LETTER.match(text)
    return match.group(1) if match and match.group(1) in letters else None


def _value(text: str, match: re.Match[str]) -> str:
    # A number that is part of "a/b" stands for the fraction's value.
    for frac in _FRACTION.finditer(text):
        if frac.start() <= match.start() < frac.end() and float(frac.group(2)) != 0:
            return str(float(frac.group(1)) / float(frac.group(2)))
    return match.group(0).replace(",", "")


def last_number(text: str) -> str | None:
    """Return the last number in ``text`` as a plain string, or None.

    Thousands separators are removed (``1,000`` -> ``1000``); a number inside a fraction ``a/b`` stands for
    the fraction's value (``3/4`` -> ``0.75``); scientific notation is kept as written.
    """
    matches = list(NUMBER_RE.finditer(text))
    return _value(text, matches[-1]) if matches else None


def first_number(text: str) -> str | None:
    """Return the first number in ``text`` (same conventions as :func:`last_number`), or None."""
    match = NUMBER_RE.search(text)
    return _value(text, match) if match else None


def final_number(response: str) -> str | None:
    """Return the number a free-form response gives as its answer, or None.

    With an answer cue, the first number of the answer tail (``The answer is 12. Earlier I said 10.`` ->
    ``12``); otherwise, or when the tail holds no number, the last number of the response.
    """
    text = response.strip()
    if _CUE_RE.search(text):
        number = first_number(answer_tail(text))
        if number is not None:
            return number
    return last_number(text)


def choice_letter(response: str, choices: Sequence[str]) -> str | None:
    """Return the option letter a free-form ``response`` picks among ``choices`` (texts, in letter order).

    In order: a letter opening the answer tail; the last ``(X)`` naming an option; the only option letter
    standing alone as a token in the tail; the choice text that occurs last in the tail, then in the whole
    response (longest on ties, case-insensitive). None when nothing matches.
    """
    text = response.strip()
    if not text:
        return None
    letters = [chr(ord("A") + i) for i in range(len(choices))]
    tail = answer_tail(text)
    lead = leading_letter(tail, letters)
    if lead:
        return lead
    in_parens = [c for c in _PAREN_LETTER.findall(text) if c in letters]
    if in_parens:
        return in_parens[-1]
    tokens = {c for c in _LETTER_TOKEN.findall(tail) if c in letters}
    if len(tokens) == 1:
        return tokens.pop()
    for scope in (tail, text):
        lowered = scope.lower()
        hits = [
            (lowered.rfind(str(c).lower()), len(str(c)), i)
            for i, c in enumerate(choices)
            if str(c) and str(c).lower() in lowered
        ]
        if hits:
            return letters[max(hits)[2]]
    return None
