"""Rule-based answer extraction for the benchmarks: moved to :mod:`keye.rewards.answers` (the data pipeline
uses it too); re-exported here for existing imports."""

from __future__ import annotations

from keye.rewards.answers import (
    NUMBER_RE,
    answer_tail,
    choice_letter,
    final_number,
    first_number,
    last_number,
    leading_letter,
)

__all__ = [
    "NUMBER_RE",
    "answer_tail",
    "choice_letter",
    "final_number",
    "first_number",
    "last_number",
    "leading_letter",
]
