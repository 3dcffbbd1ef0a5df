"""The synthetic set's answer rule (:mod:`keye.data.synth`): reading an answer off a response and checking it.

Rows carry ``answer_kind`` (``"mc"``: the answer is an option letter; ``"numeric"``: a number),
``answer``, and optionally ``choices`` (option texts in letter order) and ``tolerance`` (seconds).

- ``mc``: the MMMU rule, a letter or the option's text. The letter is read from the response with
  :func:`keye.rewards.answers.choice_letter` (letter opening the answer tail, last ``(X)``, a unique
  standalone letter, else the option text that occurs last: ``"B"``, ``"B. red"`` and ``"red"`` all pick
  option B); correct when it equals ``answer``. A response naming no option is wrong (no random fallback).
- ``numeric``: the answer number (:func:`keye.rewards.answers.final_number`: the first number after an
  answer cue, else the last number of the response); correct when ``|pred - answer| <= tolerance``
  (``tolerance`` from the row, default 0, plus 1e-9 for float round-off).

The evaluator (``keye.eval.synth``) and the AutoThink data pipeline (``keye.data.autothink``) both grade
with it, so it lives beside the set rather than in the evaluation package.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from keye.rewards.answers import choice_letter, final_number

ANSWER_KINDS = ("mc", "numeric")


def extract(response: str, item: Mapping[str, Any]) -> str | None:
    """Return the answer read from ``response``: an option letter (mc) or a number string, or None."""
    if item["answer_kind"] == "mc":
        choices = item.get("choices") or []
        if not choices:
            # Without option texts, accept any A-H letter as the option space.
            choices = [""] * 8
        return choice_letter(response, [str(c) for c in choices])
    return final_number(response)


def is_correct(prediction: str | None, item: Mapping[str, Any]) -> bool:
    """Apply the module's scoring rule to an extracted ``prediction`` (None is wrong)."""
    if prediction is None:
        return False
    if item["answer_kind"] == "mc":
        return prediction == str(item["answer"]).strip()
    try:
        diff = abs(float(prediction) - float(item["answer"]))
    except ValueError:
        return False
    return diff <= float(item.get("tolerance") or 0.0) + 1e-9
