"""Rule-based answer extraction shared by the benchmarks that have no official rule of their own.

These rules are ours (documented, deterministic, no LLM): they read an option letter or a number from a
free-form answer. The official parsers of MMMU, MathVista and Video-MME live in their own modules.

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
# A letter opening the tail: "B", "(B)", "**B**", "B." -- uppercase only, so the article "a" is never read
# as option A.
_LEADING_LETTER = re.compile(r"^\s*\**\(?([A-Z])\)?\**(?![A-Za-z0-9])")
_PAREN_LETTER = re.compile(r"\(([A-Z])\)")
_LETTER_TOKEN = re.compile(r"(?<![A-Za-z0-9])([A-Z])(?![A-Za-z0-9])")
NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|-?\.\d+")
_FRACTION = re.compile(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)")


def answer_tail(text: str) -> str:
    """Return the text after the last answer cue, trimmed (the whole trimmed text without a cue)."""
    matches = list(_CUE_RE.finditer(text))
    return text[matches[-1].end() :].strip() if matches else text.strip()


def leading_letter(text: str, letters: Sequence[str]) -> str | None:
    """Return the option letter opening ``text`` (``B``, ``(B)``, ``**B**``, ``B. ...``) if it is in ``letters``."""
    match = _LEADING_LETTER.match(text)
    return match.group(1) if match and match.group(1) in letters else None


def last_number(text: str) -> str | None:
    """Return the last number in ``text`` as a plain string, or None.

    Thousands separators are removed (``1,000`` -> ``1000``); a fraction ending the last number (``3/4``) is
    divided out (``0.75``); scientific notation is kept as written.
    """
    matches = list(NUMBER_RE.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    fractions = [f for f in _FRACTION.finditer(text) if f.end() == last.end()]
    if fractions and float(fractions[-1].group(2)) != 0:
        return str(float(fractions[-1].group(1)) / float(fractions[-1].group(2)))
    return last.group(0).replace(",", "")


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
