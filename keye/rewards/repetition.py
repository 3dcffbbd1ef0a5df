"""Repetition penalty and DAPO's soft overlong penalty; both are in [-1, 0].

Repetition (computed on the last ``max_chars`` characters, tokens as in ``keye.rewards.text.tokens``):

- n-gram: ``dup = 1 - distinct_ngrams / ngrams`` over word tokens (punctuation dropped) with
  ``n = repetition_ngram``; penalty
  ``clip((dup - threshold) / (1 - threshold), 0, 1)``; 0 for fewer than ``repetition_min_tokens`` tokens.
- lines: among lines of >= 12 non-space characters (at least 3 such lines; shorter lines such as
  ``return x + 1`` repeat naturally in code), ``dup`` = share of lines equal (after trimming) to an earlier
  line; penalty with the same threshold formula.
- loop: the longest trailing block made of one chunk of ``p <= loop_max_period`` tokens repeated at least
  ``loop_min_repeats`` times; penalty = its share of all tokens (a degenerate ending that never stops).

``repetition = -max(ngram, lines, loop)``: each term is a share of the response, so the penalty scales with
how much of the text is repeated.

Overlong (DAPO, RLEP's reward manager): with ``L_max = overlong_max_len``, ``L_buf = overlong_buffer`` and
response length ``L`` in tokens, ``overlong = clip(-(L - (L_max - L_buf)) / L_buf, -1, 0)``: 0 up to
``L_max - L_buf`` tokens, then linear down to -1 at ``L_max`` (clipped there; DAPO never sees longer).
"""

from __future__ import annotations

import math

from keye.rewards import text as _t


def _threshold_penalty(dup: float, threshold: float) -> float:
    return min(1.0, max(0.0, (dup - threshold) / (1.0 - threshold)))


def ngram_duplicate_ratio(toks: list[str], n: int) -> float:
    """``1 - distinct / total`` over the ``n``-grams of ``toks`` (0.0 when there are none)."""
    total = len(toks) - n + 1
    if total <= 0:
        return 0.0
    distinct = len(set(zip(*(toks[i:] for i in range(n)))))
    return 1.0 - distinct / total


def line_duplicate_ratio(text: str, min_chars: int = 12) -> float:
    """Share of lines (>= ``min_chars`` non-space chars, at least 3 of them) that repeat an earlier line."""
    seen: set[str] = set()
    eligible = repeated = 0
    for line in text.split("\n"):
        key = line.strip()
        if len(key) - key.count(" ") < min_chars:
            continue
        eligible += 1
        if key in seen:
            repeated += 1
        else:
            seen.add(key)
    return repeated / eligible if eligible >= 3 else 0.0


def trailing_loop_tokens(toks: list[str], max_period: int, min_repeats: int) -> int:
    """Length in tokens of the longest trailing run made of one chunk (<= ``max_period`` tokens) repeated
    at least ``min_repeats`` times; 0 if there is none. Runs in O(len(toks) * small) time."""
    n = len(toks)
    best = 0
    for p in range(1, min(max_period, n // min_repeats) + 1):
        # Count how far back toks[i] == toks[i - p] holds, starting at the end.
        i = n - 1
        while i >= p and toks[i] == toks[i - p]:
            i -= 1
        span = (n - 1 - i) + p  # matched positions plus the first copy of the chunk
        if span // p >= min_repeats and span > best:
            best = span
            if best >= n:
                break
    return best


def repetition_penalty(
    text: str,
    *,
    ngram: int = 6,
    threshold: float = 0.1,
    min_tokens: int = 32,
    loop_max_period: int = 64,
    loop_min_repeats: int = 4,
    max_chars: int = 200_000,
) -> tuple[float, str]:
    """The repetition part in [-1, 0] and a short reason naming the dominating term (rules in module doc)."""
    text = _t.tail(text, max_chars)
    toks = _t.tokens(text)
    ngram_pen = loop_pen = 0.0
    if len(toks) >= min_tokens:
        # Word n-grams only: punctuation (table pipes, LaTeX braces) repeats by design; punctuation loops
        # are still caught by the loop term, which sees every token.
        words = [tok for tok in toks if tok[0].isalnum()]
        ngram_pen = _threshold_penalty(ngram_duplicate_ratio(words, ngram), threshold)
        loop_pen = trailing_loop_tokens(toks, loop_max_period, loop_min_repeats) / len(toks)
    line_pen = _threshold_penalty(line_duplicate_ratio(text), threshold)
    terms = {"ngram": ngram_pen, "lines": line_pen, "loop": loop_pen}
    worst = max(terms, key=terms.__getitem__)
    if terms[worst] <= 0.0:
        return 0.0, ""
    return -min(1.0, terms[worst]), f"{worst} repetition {terms[worst]:.2f}"


def estimate_tokens(text: str) -> int:
    """Rough token count without a tokenizer: ``ceil(len(text) / 4)`` (about 4 characters per BPE token)."""
    return math.ceil(len(text) / 4)


def overlong_penalty(length: int, max_len: int = 3072, buffer: int = 512) -> float:
    """DAPO's soft overlong penalty in [-1, 0] for a response of ``length`` tokens (formula in module doc)."""
    expected = max_len - buffer
    return min(0.0, max(-1.0, -(length - expected) / buffer))
