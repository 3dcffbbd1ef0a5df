"""The built-in reward parts, registered under the names of ``keye.rewards.spec.BUILTIN_PARTS``.

Each function takes a ``RewardContext`` and returns the part's value or ``None`` when the part does not apply
(accuracy without a reference; an instruction check the sample's ``instructions`` extra does not ask for).
Per-sample options come from ``ctx.extra`` and fall back to the spec:

- ``choices`` (mc), ``precision`` / ``tolerance`` (numeric; ``tolerance`` is absolute), ``ordered`` (list);
- ``instructions``: a dict of the constraints the prompt states: ``json`` (True, or a JSON schema dict),
  ``json_schema``, ``code_language`` (a language, or True for the spec's default), ``markdown`` ("list" /
  "table", or True for the spec's default), ``steps`` (int = at least that many, [min, max], or True for
  the spec's window), ``length`` ([min, max] words, max may be None, or True for the spec's window). When a sample has an ``instructions`` dict,
  instruction parts it does not mention do not apply; without one, every weighted instruction part applies
  with the spec's defaults;
- ``num_tokens``: the response length in tokens for ``overlong`` (estimated from characters otherwise).
"""

from __future__ import annotations

from typing import Any

from keye.errors import KeyeInputError
from keye.rewards import accuracy as _acc
from keye.rewards import instruct as _ins
from keye.rewards import text as _t
from keye.rewards.format import check_format
from keye.rewards.mathverify import get_verifier
from keye.rewards.registry import RewardContext, _register_builtin
from keye.rewards.repetition import estimate_tokens, overlong_penalty, repetition_penalty


def _scored(ctx: RewardContext, part: str, result: tuple[float, str]) -> float:
    """The score of a ``(score, reason)`` check, its reason (if any) kept in ``ctx.info[part]``."""
    score, reason = result
    if reason:
        ctx.info[part] = reason
    return score


def format_reward(ctx: RewardContext) -> float:
    """Format part in {0, 1}: structure and requested-mode rules of ``keye.rewards.format``."""
    spec = ctx.spec
    return _scored(ctx, "format", check_format(
        ctx.response, ctx.mode, require_answer_tag=spec.require_answer_tag, require_boxed=spec.require_boxed,
        auto_requires_analysis=spec.auto_requires_analysis,
        allow_empty_think_in_no_think=spec.allow_empty_think_in_no_think, structure=ctx.structure,
    ))


def accuracy_reward(ctx: RewardContext) -> float | None:
    """Accuracy part: 1 / 0 (or +1 / -1 with ``accuracy_pm1``); None when there is no reference."""
    if ctx.reference is None or ctx.task == "none":
        return None
    correct = _correct(ctx)
    if ctx.spec.accuracy_pm1:
        return 1.0 if correct else -1.0
    return 1.0 if correct else 0.0


def _correct(ctx: RewardContext) -> bool:
    spec, extra, task = ctx.spec, ctx.extra, ctx.task
    answer = ctx.answer
    if task == "mc":
        return _acc.check_mc(_t.tail(answer, spec.answer_tail_chars), ctx.reference, extra.get("choices"))
    if task == "numeric":
        tolerance = extra.get("tolerance")
        precision = extra.get("precision", spec.numeric_precision)
        return _acc.check_numeric(
            _t.tail(answer, spec.answer_tail_chars),
            ctx.reference,
            rel_tol=0.0 if tolerance is not None else spec.numeric_rel_tol,
            abs_tol=float(tolerance) if tolerance is not None else spec.numeric_abs_tol,
            precision=None if precision is None else int(precision),
        )
    if task == "math":
        verifier = get_verifier(spec.math_timeout_s, spec.math_backend, spec.math_cache_size)
        ok, how = _acc.check_math(answer, ctx.reference, verifier, spec.math_max_chars)
        ctx.info["accuracy"] = how
        return ok
    if len(answer) > spec.answer_tail_chars and task in ("text", "list"):
        ctx.info["accuracy"] = "answer too long to compare"
        return False
    if task == "text":
        return _acc.check_text(answer, ctx.reference)
    if task == "list":
        return _acc.check_list(answer, ctx.reference, ordered=bool(extra.get("ordered", True)))
    if task == "json":
        return _acc.check_json_value(ctx.visible, ctx.reference)
    raise KeyeInputError(f"no accuracy rule for task {task!r}")


def _instruction(ctx: RewardContext, key: str) -> tuple[bool, Any]:
    """``(applies, value)`` of one instruction for this sample (see the module docstring)."""
    inst = ctx.extra.get("instructions")
    if inst is None:
        return True, None
    if not isinstance(inst, dict):
        raise KeyeInputError(f"'instructions' must be a dict, got {type(inst).__name__}")
    if key not in inst or inst[key] is False or inst[key] is None:
        return False, None
    return True, inst[key]


def json_reward(ctx: RewardContext) -> float | None:
    """JSON part in {0, 1}: the visible answer is a JSON object/array (matching the schema, if any)."""
    applies, value = _instruction(ctx, "json")
    if not applies:
        return None
    inst = ctx.extra.get("instructions") or {}
    schema = inst.get("json_schema", ctx.spec.json_schema)
    if isinstance(value, dict):  # {"json": {...schema...}} is accepted as a shorthand
        schema = value
    return _scored(ctx, "json", _ins.check_json(ctx.visible, schema))


def _named_instruction(ctx: RewardContext, key: str, default: str) -> str | None:
    """The value an instruction names (``default`` when it is just switched on), None when it does not apply."""
    applies, value = _instruction(ctx, key)
    if not applies:
        return None
    return default if value is None or value is True else str(value)


def code_reward(ctx: RewardContext) -> float | None:
    """Code part in {0, 1}: a closed fenced block of the requested language that parses (python / json)."""
    language = _named_instruction(ctx, "code_language", ctx.spec.code_language)
    return None if language is None else _scored(ctx, "code", _ins.check_code(ctx.visible, language))


def markdown_reward(ctx: RewardContext) -> float | None:
    """Markdown part in {0, 1}: a list (>= ``markdown_min_items`` items) or a table, as requested."""
    kind = _named_instruction(ctx, "markdown", ctx.spec.markdown_kind)
    if kind is None:
        return None
    return _scored(ctx, "markdown", _ins.check_markdown(ctx.visible, kind, ctx.spec.markdown_min_items))


def _window(value: Any, default_low: int, default_high: int | None, key: str) -> tuple[int, int | None]:
    if value is None or value is True:
        return default_low, default_high
    if isinstance(value, int) and not isinstance(value, bool):
        return value, None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        low, high = value
        if isinstance(low, int) and (high is None or isinstance(high, int)):
            return low, high
    raise KeyeInputError(f"instruction {key!r} must be an int or a [min, max] pair, got {value!r}")


def _in_window(ctx: RewardContext, part: str, n: int, low: int, high: int | None, unit: str | None = None) -> float:
    """1.0 when the count ``n`` is inside [low, high] (None: no upper bound), else 0.0 with the reason kept."""
    if _ins.in_window(n, low, high):
        return 1.0
    ctx.info[part] = f"{n} {unit or part}, wanted [{low}, {high}]"
    return 0.0


def steps_reward(ctx: RewardContext) -> float | None:
    """Steps part in {0, 1}: the count of step lines in the reasoning is inside the requested window."""
    applies, value = _instruction(ctx, "steps")
    if not applies:
        return None
    low, high = _window(value, ctx.spec.steps_min, ctx.spec.steps_max, "steps")
    st = ctx.structure
    source = st.think if st.ok and st.think is not None and st.think.strip() else ctx.visible
    return _in_window(ctx, "steps", _ins.count_steps(_t.tail(source, ctx.spec.max_chars)), low, high)


def length_reward(ctx: RewardContext) -> float | None:
    """Length part in {0, 1}: the visible answer's word count is inside the requested window."""
    applies, value = _instruction(ctx, "length")
    if not applies:
        return None
    low, high = _window(value, ctx.spec.length_min, ctx.spec.length_max, "length")
    return _in_window(ctx, "length", _t.count_words(ctx.visible), low, high, unit="words")


def repetition_reward(ctx: RewardContext) -> float:
    """Repetition part in [-1, 0] (rules in ``keye.rewards.repetition``), on the whole response."""
    spec = ctx.spec
    return _scored(ctx, "repetition", repetition_penalty(
        ctx.response, ngram=spec.repetition_ngram, threshold=spec.repetition_threshold,
        min_tokens=spec.repetition_min_tokens, loop_max_period=spec.loop_max_period,
        loop_min_repeats=spec.loop_min_repeats, max_chars=spec.max_chars,
    ))


def overlong_reward(ctx: RewardContext) -> float:
    """Overlong part in [-1, 0]: DAPO's soft penalty on ``num_tokens`` (or the estimated token count)."""
    n = ctx.extra.get("num_tokens")
    if n is None:
        n = estimate_tokens(ctx.response)
    elif isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise KeyeInputError(f"num_tokens must be a non-negative int, got {n!r}")
    return overlong_penalty(n, ctx.spec.overlong_max_len, ctx.spec.overlong_buffer)


_register_builtin("format", format_reward, 0.0, 1.0)
_register_builtin("accuracy", accuracy_reward, -1.0, 1.0)
_register_builtin("json", json_reward, 0.0, 1.0)
_register_builtin("code", code_reward, 0.0, 1.0)
_register_builtin("markdown", markdown_reward, 0.0, 1.0)
_register_builtin("steps", steps_reward, 0.0, 1.0)
_register_builtin("length", length_reward, 0.0, 1.0)
_register_builtin("repetition", repetition_reward, -1.0, 0.0)
_register_builtin("overlong", overlong_reward, -1.0, 0.0)
