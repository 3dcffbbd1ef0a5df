"""Format reward for Keye's output modes: think, no-think and auto-think, with optional ``<answer>``/``\\boxed{}``.

Well-formedness rules (a response breaking any of them gets format 0):

1. The (whitespace-trimmed) response is ``[<analysis>A</analysis>] [<think>T</think>] BODY``: an analysis
   block, if any, opens the response; a think block, if any, opens the response or follows the analysis
   block after whitespace only.
2. Each of ``<analysis> </analysis> <think> </think> <answer> </answer>`` occurs at most once, every opened
   tag is closed, and tags appear in that order. Anything that looks like a stray or broken tag
   (``</think``, ``<answer `` ...) anywhere else is malformed.
3. ``A`` is non-empty; ``BODY`` has non-empty text. If ``BODY`` uses ``<answer>...</answer>``, the answer is
   non-empty and only whitespace follows ``</answer>`` (text before ``<answer>`` is allowed).
4. Options: ``require_answer_tag`` needs the ``<answer>`` wrapper; ``require_boxed`` needs a balanced
   ``\\boxed{...}`` with non-empty content in the answer.

Mode rules (the mode requested in the prompt against the mode used; used = "think" when a think block with
non-empty content exists, else "no_think"):

- ``think`` (prompt ends with ``/think``): no analysis block; a non-empty think block.
- ``no_think`` (``/no_think``): no analysis block; no think block, except an empty one when
  ``allow_empty_think_in_no_think``.
- ``auto`` (no suffix): an analysis block first when ``auto_requires_analysis``; then either mode, but if
  the analysis names exactly one of ``/think`` / ``/no_think`` the used mode must be that one.
- ``None``: only well-formedness is checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from keye.errors import KeyeInputError
from keye.rewards import text as _t

_TAGS = (_t.ANALYSIS_OPEN, _t.ANALYSIS_CLOSE, _t.THINK_OPEN, _t.THINK_CLOSE, _t.ANSWER_OPEN, _t.ANSWER_CLOSE)
# Any leftover tag-like fragment once the recognised tags are removed; no nested quantifiers -> linear.
_STRAY_TAG = re.compile(r"</?\s*(?:analysis|think|answer)\b", re.IGNORECASE)

MODES = ("think", "no_think", "auto")
_MODE_ALIASES = {
    "think": "think",
    "/think": "think",
    "thinking": "think",
    "no_think": "no_think",
    "/no_think": "no_think",
    "nothink": "no_think",
    "no-think": "no_think",
    "non_think": "no_think",
    "auto": "auto",
    "auto_think": "auto",
    "/auto_think": "auto",
    "autothink": "auto",
}


def normalize_mode(mode: str | None) -> str | None:
    """Map a mode name or alias ("/think", "auto_think", "nothink", ...) to "think" / "no_think" / "auto" / None.

    Raises:
        KeyeInputError: an unknown mode name.
    """
    if mode is None:
        return None
    key = str(mode).strip().lower()
    if key in ("", "none"):
        return None
    if key not in _MODE_ALIASES:
        raise KeyeInputError(f"unknown thinking mode {mode!r}; expected one of {MODES} or None")
    return _MODE_ALIASES[key]


# The switch each mode appends to the last user text (Keye's, also Qwen3's); auto appends none.
MODE_SWITCHES = {"think": "/think", "no_think": "/no_think", "auto": ""}


def mode_suffix(mode: str | None) -> str:
    """The text a thinking mode appends to the user's prompt: ``/think``, ``/no_think``, or ``""`` for
    ``"auto"`` and None. Raises :class:`KeyeInputError` for any other mode (no aliases here: see
    :func:`normalize_mode`)."""
    if mode is None:
        return ""
    if not isinstance(mode, str) or mode not in MODE_SWITCHES:
        raise KeyeInputError(f"unknown thinking mode {mode!r}; expected one of {', '.join(MODES)} or None")
    return MODE_SWITCHES[mode]


def split_mode_switch(text: str) -> tuple[str, str | None]:
    """``(text without its switch, mode)``: a trailing ``/think`` or ``/no_think`` (whitespace around it
    ignored) is cut with the whitespace before it, giving "think" / "no_think"; text without one comes back
    unchanged with None."""
    body = text.rstrip()
    for mode in ("no_think", "think"):
        switch = MODE_SWITCHES[mode]
        if body.endswith(switch):
            return body[: -len(switch)].rstrip(), mode
    return text, None


def mode_from_prompt(prompt: str) -> str:
    """The mode a user prompt requests: ends with ``/no_think`` -> "no_think", ``/think`` -> "think", else "auto"."""
    return split_mode_switch(_t.coerce_text(prompt)[-64:])[1] or "auto"


@dataclass(frozen=True)
class Structure:
    """The parsed layout of a response.

    Attributes:
        ok: well-formed by rules 1-3 of the module docstring.
        reason: why not (empty when ``ok``).
        analysis / think: the block contents (None when absent).
        body: the text after the last reasoning block (trimmed).
        answer: the content of the ``<answer>`` block (None when absent).
        used_mode: "think" if a non-empty think block exists, else "no_think".
    """

    ok: bool
    reason: str
    analysis: str | None = None
    think: str | None = None
    body: str = ""
    answer: str | None = None

    @property
    def used_mode(self) -> str:
        """ "think" when the think block has non-whitespace content, else "no_think"."""
        return "think" if self.think is not None and self.think.strip() else "no_think"


def _bad(reason: str, **kw: object) -> Structure:
    return Structure(False, reason, **kw)  # type: ignore[arg-type]


def parse_structure(response: str) -> Structure:
    """Parse ``response`` into its analysis / think / answer blocks in linear time (never raises)."""
    s = _t.coerce_text(response).strip()
    counts = {tag: s.count(tag) for tag in _TAGS}
    for tag, n in counts.items():
        if n > 1:
            return _bad(f"{tag} occurs {n} times")
    for open_tag, close_tag in (
        (_t.ANALYSIS_OPEN, _t.ANALYSIS_CLOSE),
        (_t.THINK_OPEN, _t.THINK_CLOSE),
        (_t.ANSWER_OPEN, _t.ANSWER_CLOSE),
    ):
        if counts[open_tag] != counts[close_tag]:
            return _bad(f"{open_tag} and {close_tag} are not paired")
    pos = 0
    analysis = think = None
    if counts[_t.ANALYSIS_OPEN]:
        if not s.startswith(_t.ANALYSIS_OPEN):
            return _bad("<analysis> must open the response")
        end = s.find(_t.ANALYSIS_CLOSE)
        if end < 0:
            return _bad("</analysis> comes before <analysis>")
        analysis = s[len(_t.ANALYSIS_OPEN) : end]
        if not analysis.strip():
            return _bad("empty <analysis> block")
        pos = end + len(_t.ANALYSIS_CLOSE)
    if counts[_t.THINK_OPEN]:
        start = s.find(_t.THINK_OPEN)
        if start < pos or s[pos:start].strip():
            return _bad("<think> must open the response or follow </analysis> directly")
        end = s.find(_t.THINK_CLOSE)
        if end < start:
            return _bad("</think> comes before <think>")
        think = s[start + len(_t.THINK_OPEN) : end]
        pos = end + len(_t.THINK_CLOSE)
    body = s[pos:].strip()
    inner = [x for x in (analysis, think) if x is not None]
    answer = None
    if counts[_t.ANSWER_OPEN]:
        a = body.find(_t.ANSWER_OPEN)
        b = body.find(_t.ANSWER_CLOSE)
        if a < 0 or b < 0:
            return _bad("<answer> block must come after the reasoning blocks")
        if b < a:
            return _bad("</answer> comes before <answer>")
        answer = body[a + len(_t.ANSWER_OPEN) : b]
        if body[b + len(_t.ANSWER_CLOSE) :].strip():
            return _bad("text after </answer>")
        if not answer.strip():
            return _bad("empty <answer> block")
        inner += [body[:a], answer]
    else:
        inner.append(body)
    if not body:
        return _bad("no answer after the reasoning", analysis=analysis, think=think)
    for piece in inner:
        if _STRAY_TAG.search(piece):
            return _bad("stray or malformed tag", analysis=analysis, think=think, body=body, answer=answer)
    return Structure(True, "", analysis=analysis, think=think, body=body, answer=answer)


def has_valid_boxed(answer: str) -> bool:
    """True when ``answer`` contains ``\\boxed{`` whose braces balance and whose content is non-empty."""
    start = answer.rfind(_t.BOXED)
    if start < 0:
        return False
    start += len(_t.BOXED)
    close = _t.closing_brace(answer, start)
    return close >= 0 and bool(answer[start:close].strip())


def check_format(
    response: str,
    mode: str | None,
    *,
    require_answer_tag: bool = False,
    require_boxed: bool = False,
    auto_requires_analysis: bool = True,
    allow_empty_think_in_no_think: bool = True,
    structure: Structure | None = None,
) -> tuple[float, str]:
    """Score the format of ``response`` for the requested ``mode``: ``(1.0, "")`` or ``(0.0, reason)``.

    ``mode`` is "think" / "no_think" / "auto" / None (see the module docstring for every rule).
    """
    st = structure if structure is not None else parse_structure(response)
    if not st.ok:
        return 0.0, st.reason
    if require_answer_tag and st.answer is None:
        return 0.0, "answer is not wrapped in <answer>...</answer>"
    if require_boxed and not has_valid_boxed(st.answer if st.answer is not None else st.body):
        return 0.0, "no balanced, non-empty \\boxed{...} in the answer"
    if mode in ("think", "no_think") and st.analysis is not None:
        return 0.0, f"<analysis> block in forced {mode} mode"
    if mode == "think" and st.used_mode != "think":
        return 0.0, "think mode requested but no non-empty <think> block"
    if mode == "no_think" and st.think is not None:
        if st.think.strip() or not allow_empty_think_in_no_think:
            return 0.0, "no_think mode requested but a <think> block is present"
    if mode == "auto":
        if st.analysis is None:
            if auto_requires_analysis:
                return 0.0, "auto mode requires an <analysis> block first"
        else:
            says_think = "/think" in st.analysis
            says_no = "/no_think" in st.analysis
            if says_think != says_no:
                chosen = "think" if says_think else "no_think"
                if chosen != st.used_mode:
                    return 0.0, f"analysis chose /{chosen} but the response used {st.used_mode}"
    return 1.0, ""
