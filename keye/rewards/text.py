"""Linear-time text helpers shared by the reward parts: input coercion, answer extraction, normalisation.

Every function here runs in time linear in its input (``str.find`` / ``str.rfind`` scans and regexes without
nested unbounded quantifiers), so none of them can hang on adversarial text. Regex-based parsers that only
need the end of a long answer work on its last ``tail_chars`` characters.
"""

from __future__ import annotations

import re
import unicodedata

ANALYSIS_OPEN, ANALYSIS_CLOSE = "<analysis>", "</analysis>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
BOXED = "\\boxed{"

# CJK scripts are written without spaces: each character counts as one word / token.
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
# Word runs are cut into pieces of at most 16 characters so that a loop with no spaces ("abcabcabc...")
# still shows up as repeated tokens.
_TOKEN_RE = re.compile(rf"[{_CJK}]|[^\W{_CJK}]{{1,16}}|[^\w\s]")
_WORD_RE = re.compile(rf"[{_CJK}]|[^\s{_CJK}]+")


def coerce_text(value: object) -> str:
    """Return ``value`` as a ``str``: ``None`` -> ``""``, bytes decoded as UTF-8 with replacement.

    Any other non-string is converted with ``str()``; this never raises for ``str``/``bytes``/``None``.
    """
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


_EOS_MARKERS = ("<|im_end|>", "<|endoftext|>")


def strip_eos(text: str) -> str:
    """Remove trailing end-of-sequence markers (``<|im_end|>``, ``<|endoftext|>``) and the whitespace around them.

    Responses decoded without ``skip_special_tokens`` (or RLEP's replayed strings with an EOS appended) end
    with these markers; they are not part of the answer.
    """
    end = len(text)
    while True:
        # Index arithmetic instead of repeated slicing keeps this linear for any number of markers.
        cut = end
        while cut > 0 and text[cut - 1].isspace():
            cut -= 1
        for marker in _EOS_MARKERS:
            if text.endswith(marker, 0, cut):
                end = cut - len(marker)
                break
        else:
            return text[:end]


def tokens(text: str) -> list[str]:
    """Split ``text`` into rough tokens: CJK characters, word pieces of <= 16 chars, single punctuation marks."""
    return _TOKEN_RE.findall(text)


def count_words(text: str) -> int:
    """Number of words in ``text``: whitespace-separated runs, each CJK character counting as one word."""
    return sum(1 for _ in _WORD_RE.finditer(text))


def closing_brace(text: str, start: int = 0, end: int | None = None) -> int:
    """Index of the ``}`` that closes a brace opened just before ``text[start]``, or -1 when none does
    before ``end`` (default: the end of ``text``).

    Braces in between nest (``"a{b}c}"`` -> 5); linear time (``str.find`` / ``str.count`` scans).
    """
    depth = 1
    pos = start
    while True:
        close = text.find("}", pos, end)
        if close < 0:
            return -1
        # Opening braces between the previous stop and this closing brace raise the depth first.
        depth += text.count("{", pos, close) - 1
        if depth <= 0:
            return close
        pos = close + 1


def extract_boxed(text: str) -> str:
    """KeyeChat's boxed extraction (``docs/evaluation.md`` section 3, step 5), in linear time.

    Take the text after the last literal ``\\boxed{`` (the whole text when there is none), then cut just before
    the ``}`` that brings a brace counter starting at 1 to 0; with no such brace keep everything. As in the
    original, text without a box but with an unbalanced ``}`` is cut at that brace (``"f(x)} = 3"`` -> ``"f(x)"``).
    """
    start = text.rfind(BOXED)
    tail = text if start < 0 else text[start + len(BOXED) :]
    close = closing_brace(tail)
    return tail if close < 0 else tail[:close]


def last_boxed(text: str) -> str | None:
    """Content of the last *closed* ``\\boxed{...}`` in ``text`` (nested braces balanced), or None.

    Unlike :func:`extract_boxed` (KeyeChat's rule, which never fails), a box whose braces never close is
    skipped in favour of an earlier closed one, and text without a closed box gives None.
    """
    limit = len(text)
    pos = text.rfind(BOXED)
    while pos >= 0:
        start = pos + len(BOXED)
        close = closing_brace(text, start, limit)
        if close >= 0:
            return text[start:close]
        # A box that never closes keeps every earlier box open past its own start, so an earlier box can
        # only close before it: bounding the scan there keeps the whole search linear.
        limit = pos
        pos = text.rfind(BOXED, 0, pos)
    return None


def last_answer_block(text: str) -> str | None:
    """Content of the last non-greedy ``<answer>...</answer>`` pair, or ``None`` when no pair is closed.

    Equivalent to the last match of ``re.findall(r"<answer>(.*?)</answer>", text, re.S)`` but linear.
    """
    pos, last = 0, None
    while True:
        a = text.find(ANSWER_OPEN, pos)
        if a < 0:
            return last
        b = text.find(ANSWER_CLOSE, a + len(ANSWER_OPEN))
        if b < 0:
            return last
        last = text[a + len(ANSWER_OPEN) : b]
        pos = b + len(ANSWER_CLOSE)


def strip_reasoning(text: str) -> str:
    """Drop everything up to the last ``</analysis>`` and then up to the last ``</think>`` (KeyeChat steps 1-2).

    After ``</think>`` leading newlines are dropped and the text is trimmed, as KeyeChat does.
    """
    i = text.rfind(ANALYSIS_CLOSE)
    if i >= 0:
        text = text[i + len(ANALYSIS_CLOSE) :]
    i = text.rfind(THINK_CLOSE)
    if i >= 0:
        text = text[i + len(THINK_CLOSE) :].lstrip("\n").strip()
    return text


def final_answer(text: str) -> str:
    """The prediction KeyeChat's post-processing makes of a raw response (``docs/evaluation.md`` section 3).

    1. keep the text after the last ``</analysis>``; 2. then after the last ``</think>`` (leading newlines
    dropped, trimmed); 3. without ``<answer>``: boxed extraction; 4. with ``<answer>``: boxed extraction of the
    last closed ``<answer>...</answer>`` block, or the text unchanged when no block is closed.
    """
    text = strip_reasoning(text)
    if ANSWER_OPEN not in text:
        return extract_boxed(text)
    block = last_answer_block(text)
    return text if block is None else extract_boxed(block)


def visible_answer(text: str) -> str:
    """The user-visible answer without boxed extraction: reasoning dropped, last ``<answer>`` block if closed.

    Used by instruction-format rewards (JSON, code, markdown, length) that judge the answer's layout.
    """
    text = strip_reasoning(text)
    block = last_answer_block(text)
    return (text if block is None else block).strip()


_ARTICLES = {"a", "an", "the"}


def normalize_text(text: str) -> str:
    """Normalise free text for exact matching.

    NFKC, case-folded, every Unicode punctuation/symbol character replaced by a space, the English articles
    a/an/the removed, whitespace collapsed (the SQuAD-style rule). ``"The Eiffel-Tower."`` -> ``"eiffel tower"``.
    """
    text = unicodedata.normalize("NFKC", text).casefold()
    chars = [" " if unicodedata.category(ch)[0] in "PSZC" else ch for ch in text]
    words = "".join(chars).split()
    return " ".join(w for w in words if w not in _ARTICLES)


def tail(text: str, limit: int) -> str:
    """The last ``limit`` characters of ``text`` (all of it when shorter); answers conclude at the end."""
    return text if len(text) <= limit else text[-limit:]
