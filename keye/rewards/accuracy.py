"""Answer accuracy by task type. Every checker returns True / False on the final answer and never raises.

The final answer is what Keye's evaluation post-processing extracts (``keye.rewards.text.final_answer``:
text after ``</analysis>`` / ``</think>``, last ``<answer>`` block, last ``\\boxed{}``). Rules per task:

- ``mc``: the letter is read from the answer by the first rule that yields one valid letter:
  (1) the whole answer is a letter form (``B``, ``(B)``, ``B.``, ``**B**``, ``\\text{B}``); (2) it starts with a
  letter and a delimiter (``B. mitochondria``, ``(B) ...``); (3) the last ``answer``/``option``/``choice``
  phrase followed by a letter (``Answer: B``, ``the answer is (C)``); (4) exactly one valid letter occurs as a
  whole token after replacing ``.()[],:;!*#{}`` by spaces (VLMEvalKit's ``can_infer``); (5) the answer equals
  one option text, or exactly one option text occurs in it (case-insensitive). Letters are uppercase only;
  valid letters are A.. one per ``choices`` entry (A-Z without choices). The gold is a letter, a list of
  letters, or an option text (mapped to its letter through ``choices``).
- ``numeric``: the last number of the answer (thousands commas, decimals, exponents, ``a/b``, ``\\frac{a}{b}``,
  Unicode minus, a trailing ``%``; units and currency around it ignored; a ``-`` right after a word or
  digit is a hyphen, so ``3-5`` ends in ``5``) equals the gold within
  ``|p - g| <= max(abs_tol, rel_tol * |g|)``, or at ``precision`` decimals both round to the same value
  (MathVista's float rule). With a ``%`` on exactly one side, ``p`` also matches ``g * 100`` or ``g / 100``.
- ``math``: (1) equal after LaTeX-cosmetic normalisation (spaces, ``\\left``/``\\right``, ``\\dfrac``, ``$``,
  trailing ``.``); (2) both sides one plain number, ``a/b`` or ``\\frac{a}{b}`` -> compared as numbers
  with ``rel 1e-9``; (3) otherwise
  math-verify (``parse`` + ``verify``) under the hard time limit of ``keye.rewards.mathverify``.
- ``text``: ``normalize_text`` of the answer equals that of the gold (or of any gold in a list).
- ``list``: the answer's outer brackets are dropped and it is split on ``,`` ``;`` and ``and``; the items
  must match the gold's items one to one (in order unless ``ordered=False``), each as a number (when both
  parse) or as normalised text.
- ``json``: the answer parses as JSON (as in the ``json`` instruction check) and equals the gold value.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

from keye.rewards import instruct as _instruct
from keye.rewards import text as _t

TASKS = ("mc", "numeric", "math", "text", "list", "json", "none")
_TASK_ALIASES = {
    "multiple_choice": "mc",
    "multi_choice": "mc",
    "choice": "mc",
    "int": "numeric",
    "integer": "numeric",
    "float": "numeric",
    "number": "numeric",
    "latex": "math",
    "expression": "math",
    "free_form": "text",
    "string": "text",
    "open": "text",
}

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
_MC_WHOLE = re.compile(r"[\(\[]?\s{0,3}([A-Z])\s{0,3}[\)\]]?\s{0,3}[.:)]?")
_MC_LEAD = re.compile(r"[\(\[]?([A-Z])(?:[\)\]][.:]?|[.:])\s")
_MC_PHRASE = re.compile(
    r"\b(?i:answer|option|choice)(?:\s{1,3}(?i:is)\b)?(?:\s{0,3}(?i:option|choice))?[\s:：]{0,5}[\(\[]?([A-Z])(?![A-Za-z0-9])"
)
_MC_PUNCT = str.maketrans({c: " " for c in ".()[],:;!*#{}"})
_MC_DECOR = ("\\text{", "\\textbf{", "\\mathrm{", "\\mathbf{")

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+"
_NUMBER_RE = re.compile(
    r"(?P<fo>(?<![\w.)\]}])[-+−])?\\[dt]?frac\s{0,3}\{\s{0,3}(?P<fs>[-+−]?)\s{0,3}(?P<fn>" + _NUM + r")\s{0,3}\}\s{0,3}"
    r"\{\s{0,3}(?P<fd>" + _NUM + r")\s{0,3}\}"
    r"|(?P<fo2>(?<![\w.)\]}])[-+−])?\\[dt]?frac(?P<fa>\d)(?P<fb>\d)"
    # A minus glued to a preceding word or digit is a hyphen ("2024-05", "3-5"), not a sign.
    r"|(?P<s>(?<![\w.)\]}])[-+−])?(?P<n>" + _NUM + r")(?:\s{0,3}/\s{0,3}(?P<d>" + _NUM + r"))?(?P<pct>\s{0,3}(?:%|\\%))?"
)
_PLAIN_NUMBER = re.compile(r"[-+−]?(?:" + _NUM + r")(?:\s*/\s*(?:" + _NUM + r"))?")
_LATEX_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", " ", "\t", "\n")


def normalize_task(task: str | None, reference: Any, extra: dict[str, Any] | None = None) -> str:
    """Resolve a task name or alias; with ``task=None`` infer it from the reference.

    Inference: None -> "none"; list/tuple -> "list"; dict -> "json"; int/float -> "numeric"; a single
    uppercase letter (or any reference with ``choices`` given) -> "mc"; a plain number string -> "numeric";
    a string with ``\\``, ``^``, ``{`` or ``_`` -> "math"; any other string -> "text".

    Raises:
        KeyeInputError: an unknown task name.
    """
    from keye.errors import KeyeInputError

    if task is not None:
        key = str(task).strip().lower()
        key = _TASK_ALIASES.get(key, key)
        if key not in TASKS:
            raise KeyeInputError(f"unknown task {task!r}; expected one of {TASKS} (or None to infer it)")
        return key
    if reference is None:
        return "none"
    if isinstance(reference, (list, tuple)):
        return "list"
    if isinstance(reference, dict):
        return "json"
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        return "numeric"
    ref = _t.coerce_text(reference).strip()
    if (extra or {}).get("choices") is not None or (len(ref) == 1 and ref in _LETTERS):
        return "mc"
    if _PLAIN_NUMBER.fullmatch(ref):
        return "numeric"
    if any(c in ref for c in "\\^{_"):
        return "math"
    return "text"


# -- multiple choice ------------------------------------------------------------------------------------------
def _choices_map(choices: Any) -> dict[str, str]:
    if choices is None:
        return {}
    if isinstance(choices, dict):
        return {str(k).strip().upper(): _t.coerce_text(v) for k, v in choices.items()}
    if isinstance(choices, (list, tuple)):
        return {_LETTERS[i]: _t.coerce_text(v) for i, v in enumerate(choices[: len(_LETTERS)])}
    return {}


def parse_choice(answer: str, choices: Any = None) -> str | None:
    """The option letter ``answer`` picks (rules (1)-(5) of the module docstring), or None."""
    options = _choices_map(choices)
    valid = set(options) if options else set(_LETTERS)
    s = answer.strip()
    for deco in _MC_DECOR:
        s = s.replace(deco, "")
    s = s.replace("**", "").replace("`", "").replace("$", "").strip()
    m = _MC_WHOLE.fullmatch(s) if len(s) <= 16 else None
    if m and m.group(1) in valid:
        return m.group(1)
    m = _MC_LEAD.match(s)
    if m and m.group(1) in valid:
        return m.group(1)
    found = [g for g in _MC_PHRASE.findall(s) if g in valid]
    if found:
        return found[-1]
    letters = {tok for tok in s.translate(_MC_PUNCT).split() if len(tok) == 1 and tok in valid}
    if len(letters) == 1:
        return letters.pop()
    if options:
        low = _t.normalize_text(s)
        normalized = {k: _t.normalize_text(v) for k, v in options.items()}
        exact = [k for k, v in normalized.items() if v and v == low]
        if len(exact) == 1:
            return exact[0]
        inside = [k for k, v in normalized.items() if v and re.search(r"(?:^|\s)" + re.escape(v) + r"(?:\s|$)", low)]
        if len(inside) == 1:
            return inside[0]
    return None


def _gold_letters(reference: Any, choices: Any) -> set[str]:
    refs = reference if isinstance(reference, (list, tuple, set)) else [reference]
    options = _choices_map(choices)
    out: set[str] = set()
    for ref in refs:
        r = _t.coerce_text(ref).strip()
        letter = parse_choice(r, choices) if len(r) <= 4 else None
        if letter is not None and (not options or letter in options):
            out.add(letter)
            continue
        target = _t.normalize_text(r)
        out.update(k for k, v in options.items() if _t.normalize_text(v) == target)
    return out


def check_mc(answer: str, reference: Any, choices: Any = None) -> bool:
    """True if the letter parsed from ``answer`` is one of the gold letters."""
    gold = _gold_letters(reference, choices)
    if not gold:
        return False
    return parse_choice(answer, choices) in gold


# -- numbers --------------------------------------------------------------------------------------------------
def _to_float(num: str) -> float:
    return float(num.replace(",", ""))


def parse_number(text: str) -> tuple[float, bool] | None:
    """``(value, has_percent)`` of the last number in ``text`` (forms in the module docstring), or None."""
    last = None
    for last in _NUMBER_RE.finditer(text):  # noqa: B007 - only the last match is wanted
        pass
    if last is None:
        return None
    g = last.groupdict()
    try:
        if g["fn"] is not None:
            value = _to_float(g["fn"]) / _to_float(g["fd"])
            # -\frac{1}{2} and \frac{-1}{2} are negative, -\frac{-1}{2} is positive.
            sign = "-" if (g["fo"] in ("-", "−")) != (g["fs"] in ("-", "−")) else ""
        elif g["fa"] is not None:
            value, sign = int(g["fa"]) / int(g["fb"]), g["fo2"] or ""
        else:
            value = _to_float(g["n"])
            if g["d"] is not None:
                value /= _to_float(g["d"])
            sign = g["s"]
    except (ZeroDivisionError, ValueError, OverflowError):
        return None
    if sign in ("-", "−"):
        value = -value
    if not math.isfinite(value):
        return None
    return value, bool(g.get("pct"))


def numbers_match(
    pred: float, gold: float, *, rel_tol: float, abs_tol: float, precision: int | None = None
) -> bool:
    """Tolerance / precision comparison of two finite floats (rules in the module docstring)."""
    if precision is not None:
        try:
            return round(pred, precision) == round(gold, precision)
        except OverflowError:
            return False
    return abs(pred - gold) <= max(abs_tol, rel_tol * abs(gold))


def check_numeric(
    answer: str,
    reference: Any,
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    precision: int | None = None,
) -> bool:
    """True if the last number of ``answer`` matches the numeric ``reference`` (number or string)."""
    if isinstance(reference, (int, float)) and not isinstance(reference, bool):
        gold = (float(reference), False)
        if not math.isfinite(gold[0]):
            return False
    else:
        gold = parse_number(_t.coerce_text(reference))
    pred = parse_number(answer)
    if gold is None or pred is None:
        return False
    (p, p_pct), (g, g_pct) = pred, gold
    cands = [p]
    if p_pct != g_pct:
        cands += [p * 100.0, p / 100.0]
    return any(numbers_match(c, g, rel_tol=rel_tol, abs_tol=abs_tol, precision=precision) for c in cands)


def _simple_number(expr: str) -> float | None:
    """The value of ``expr`` if it is exactly one number, ``a/b`` or ``\\frac{a}{b}`` (no percent), else None."""
    m = _NUMBER_RE.fullmatch(expr) if len(expr) <= 64 else None
    if m is None or m.group("pct"):
        return None
    parsed = parse_number(expr)
    return None if parsed is None else parsed[0]


# -- math -----------------------------------------------------------------------------------------------------
def normalize_latex(expr: str) -> str:
    """Remove LaTeX cosmetics: ``\\left``/``\\right``, thin spaces, ``$``, whitespace; ``\\dfrac``/``\\tfrac``
    -> ``\\frac``; a trailing ``.``; an outer ``\\text{...}`` wrapper is kept (content differs semantically)."""
    s = expr.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for noise in _LATEX_NOISE:
        s = s.replace(noise, "")
    return s.rstrip(".")


def check_math(answer: str, reference: Any, verifier: Any, max_chars: int = 1000) -> tuple[bool, str]:
    """``(correct, how)``: ``how`` is "string", "number", "math-verify", "math-verify-cached", "timeout",
    "error" or "too-long"; ``verifier`` is a ``keye.rewards.mathverify.MathVerifier``."""
    golds = reference if isinstance(reference, (list, tuple)) else [reference]
    pred = answer.strip()
    if not pred:
        return False, "empty"
    pred_norm = normalize_latex(pred)
    for gold in golds:
        g = _t.coerce_text(gold).strip()
        if g and normalize_latex(g) == pred_norm:
            return True, "string"
    if len(pred) > max_chars:
        return False, "too-long"
    how = "number"
    for gold in golds:
        g = _t.coerce_text(gold).strip()
        if not g:
            continue
        gv, pv = _simple_number(normalize_latex(g)), _simple_number(pred_norm)
        if gv is not None and pv is not None:
            if numbers_match(pv, gv, rel_tol=1e-9, abs_tol=1e-12):
                return True, "number"
            continue
        if len(g) > max_chars:
            continue
        ok = verifier.equivalent(g, pred)
        status = verifier.last_status
        how = {"ok": "math-verify", "cached": "math-verify-cached"}.get(status, status)
        if ok:
            return True, how
    return False, how


# -- text, lists, json ----------------------------------------------------------------------------------------
def check_text(answer: str, reference: Any) -> bool:
    """True if the normalised answer equals the normalised gold (any element when the gold is a list)."""
    golds = reference if isinstance(reference, (list, tuple, set)) else [reference]
    pred = _t.normalize_text(answer)
    return any(pred == _t.normalize_text(_t.coerce_text(g)) and pred != "" for g in golds)


_LIST_SPLIT = re.compile(r"\s*(?:[,;]|\band\b)\s*")


def split_list(text: str) -> list[str]:
    """Items of a list answer: outer ``[]``/``()``/``{}`` dropped, split on ``,`` ``;`` ``and``, empties removed."""
    s = text.strip()
    if len(s) >= 2 and s[0] + s[-1] in ("[]", "()", "{}"):
        s = s[1:-1]
    return [item for item in _LIST_SPLIT.split(s) if item.strip()]


def _item_match(pred: str, gold: Any) -> bool:
    if isinstance(gold, (int, float)) and not isinstance(gold, bool):
        gold_s = repr(gold)
    else:
        gold_s = _t.coerce_text(gold).strip()
    p_num = _PLAIN_NUMBER.fullmatch(pred.strip())
    g_num = _PLAIN_NUMBER.fullmatch(gold_s)
    if p_num and g_num:
        pv, gv = parse_number(pred), parse_number(gold_s)
        return pv is not None and gv is not None and numbers_match(pv[0], gv[0], rel_tol=1e-9, abs_tol=1e-12)
    return _t.normalize_text(pred) == _t.normalize_text(gold_s) and _t.normalize_text(gold_s) != ""


def check_list(answer: str, reference: Any, ordered: bool = True) -> bool:
    """True if the answer's items match the gold list item for item (order-free when ``ordered=False``)."""
    if isinstance(reference, (list, tuple)):
        golds: Sequence[Any] = list(reference)
    else:
        golds = split_list(_t.coerce_text(reference))
    preds = split_list(answer)
    if not golds or len(preds) != len(golds):
        return False
    if ordered:
        return all(_item_match(p, g) for p, g in zip(preds, golds))
    remaining = list(golds)
    for p in preds:
        hit = next((i for i, g in enumerate(remaining) if _item_match(p, g)), None)
        if hit is None:
            return False
        remaining.pop(hit)
    return True


def check_json_value(answer: str, reference: Any) -> bool:
    """True if ``answer`` parses as a JSON object/array equal to ``reference`` (a value or a JSON string)."""
    if isinstance(reference, str):
        try:
            reference = json.loads(reference)
        except (ValueError, RecursionError):
            return False
    ok, value = _instruct.parse_json_answer(answer)
    if not ok:
        return False
    try:
        return bool(value == reference)
    except RecursionError:
        return False
