"""The synthetic set's answer rule (:mod:`keye.data.synth`): reading an answer off a response and checking it.

Rows carry ``answer_kind`` (``"mc"``: the answer is an option letter; ``"numeric"``: a number;
``"text"``: a word or name, for the free-form questions of :mod:`keye.data.synth_forms`), ``answer``, and
optionally ``choices`` (option texts in letter order, or a text question's candidate answers) and
``tolerance`` (seconds).

- ``mc``: the MMMU rule, a letter or the option's text. The letter is read from the response with
  :func:`keye.rewards.answers.choice_letter` (letter opening the answer tail, last ``(X)``, a unique
  standalone letter, else the option text that occurs last: ``"B"``, ``"B. red"`` and ``"red"`` all pick
  option B); correct when it equals ``answer``. A response naming no option is wrong (no random fallback).
- ``numeric``: the answer number (:func:`keye.rewards.answers.final_number`: the first number after an
  answer cue, else the last number of the response); correct when ``|pred - answer| <= tolerance``
  (``tolerance`` from the row, default 0, plus 1e-9 for float round-off).
- ``text``: the candidate (``choices``) the answer tail names last, as whole words, case-insensitive and
  without a leading "the" (``"It moves right."`` -> ``right``; ``"red circle"`` -> ``the red circle``), else
  the one the whole response names last; correct when it is ``answer``. A reply naming no candidate is wrong.

The evaluator (``keye.eval.synth``) and the AutoThink data pipeline (``keye.data.autothink``) both grade
with it, so it lives beside the set rather than in the evaluation package.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from keye.rewards.answers import answer_tail, choice_letter, final_number

ANSWER_KINDS = ("mc", "numeric", "text")


def _bare(text: str) -> str:
    text = text.strip().lower()
    return text[4:] if text.startswith("the ") else text


def named_candidate(response: str, candidates: Sequence[str]) -> str | None:
    """Return the candidate ``response`` names last (whole words, case-insensitive, a leading "the"
    ignored; longest on ties), looking in the answer tail first, then the whole response; None if none."""
    for scope in (answer_tail(response), response):
        lowered = scope.lower()
        hits = []
        for c in candidates:
            found = [m.start() for m in re.finditer(rf"(?<!\w){re.escape(_bare(str(c)))}(?!\w)", lowered)]
            if _bare(str(c)) and found:
                hits.append((found[-1], len(str(c)), str(c)))
        if hits:
            return max(hits)[2]
    return None


def extract(response: str, item: Mapping[str, Any]) -> str | None:
    """Return the answer read from ``response``: an option letter (mc), a number string (numeric) or the
    candidate it names (text, :func:`named_candidate`), or None."""
    if item["answer_kind"] == "mc":
        choices = item.get("choices") or []
        if not choices:
            # Without option texts, accept any A-H letter as the option space.
            choices = [""] * 8
        return choice_letter(response, [str(c) for c in choices])
    if item["answer_kind"] == "text":
        return named_candidate(response, [str(c) for c in item.get("choices") or [item["answer"]]])
    return final_number(response)


def is_correct(prediction: str | None, item: Mapping[str, Any]) -> bool:
    """Apply the module's scoring rule to an extracted ``prediction`` (None is wrong)."""
    if prediction is None:
        return False
    if item["answer_kind"] == "mc":
        return prediction == str(item["answer"]).strip()
    if item["answer_kind"] == "text":
        return _bare(prediction) == _bare(str(item["answer"]))
    try:
        diff = abs(float(prediction) - float(item["answer"]))
    except ValueError:
        return False
    return diff <= float(item.get("tolerance") or 0.0) + 1e-9
