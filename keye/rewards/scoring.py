"""Composition: ``score`` one response, ``score_batch`` a list for RL, ``aggregate_stats`` for logging."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from keye.errors import KeyeInputError
from keye.rewards import text as _t
from keye.rewards.accuracy import normalize_task
from keye.rewards.format import mode_from_prompt, normalize_mode
from keye.rewards.registry import RewardContext, get_reward
from keye.rewards.spec import RewardSpec

_DEFAULT_SPEC: RewardSpec | None = None


@dataclass
class RewardResult:
    """The reward of one response.

    Attributes:
        total: ``sum(weight * parts[name])`` over the parts that applied (finite).
        parts: value of every part that applied, each inside its documented range.
        info: short diagnostics by part (why format failed, which accuracy path decided, ...).
    """

    total: float
    parts: dict[str, float]
    info: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """``{"total": ..., "parts": {...}, "info": {...}}`` (JSON-serialisable)."""
        return {"total": self.total, "parts": dict(self.parts), "info": dict(self.info)}


def _default_spec() -> RewardSpec:
    global _DEFAULT_SPEC
    if _DEFAULT_SPEC is None:
        _DEFAULT_SPEC = RewardSpec()
    return _DEFAULT_SPEC


def score(
    response: Any,
    reference: Any = None,
    task: str | None = None,
    mode: str | None = None,
    spec: RewardSpec | None = None,
    **extra: Any,
) -> RewardResult:
    """Score one response with every weighted part of ``spec``.

    Args:
        response: the model output; ``None`` counts as ``""``, bytes are decoded as UTF-8, trailing
            ``<|im_end|>`` / ``<|endoftext|>`` markers are dropped. Any string is accepted (empty, megabytes
            long, unbalanced tags, NUL bytes): built-in parts never raise on it.
        reference: ground truth for ``accuracy`` (None = accuracy does not apply).
        task: "mc", "numeric", "math", "text", "list", "json", "none" or an alias; None infers it from
            ``reference`` (see ``keye.rewards.accuracy.normalize_task``).
        mode: requested thinking mode "think" / "no_think" / "auto" (aliases accepted); None = take it from
            a ``prompt=`` extra if given (suffix ``/think``, ``/no_think``, else auto), otherwise not checked.
        spec: weights and options (default ``RewardSpec()``: format 1, accuracy 1).
        **extra: per-sample extras (see ``keye.rewards.builtins``): ``choices``, ``precision``,
            ``tolerance``, ``ordered``, ``instructions``, ``num_tokens``, ``prompt``, custom keys.

    Returns:
        ``RewardResult(total, parts, info)``.

    Raises:
        KeyeInputError: unknown task or mode, or malformed extras (not for any response text).
    """
    spec = spec if spec is not None else _default_spec()
    if not isinstance(spec, RewardSpec):
        raise KeyeInputError(f"spec must be a RewardSpec, got {type(spec).__name__}")
    text = _t.strip_eos(_t.coerce_text(response))
    resolved_mode = normalize_mode(mode)
    if resolved_mode is None and extra.get("prompt") is not None:
        resolved_mode = mode_from_prompt(extra["prompt"])
    ctx = RewardContext(
        response=text,
        reference=reference,
        task=normalize_task(task, reference, extra),
        mode=resolved_mode,
        spec=spec,
        extra=extra,
    )
    parts: dict[str, float] = {}
    total = 0.0
    for name, weight in spec.weights().items():
        info = get_reward(name)
        value = info.fn(ctx)
        if value is None:
            continue
        value = float(value)
        if math.isnan(value):
            ctx.info[name] = "reward returned NaN"
            value = info.low
        value = min(info.high, max(info.low, value))
        parts[name] = value
        total += weight * value
    return RewardResult(total=total, parts=parts, info=ctx.info)


def _per_sample(name: str, value: Any, n: int, *, broadcast: bool) -> list[Any]:
    # Lists and tuples are per-sample columns; with ``broadcast`` any other value is shared by every sample.
    if broadcast and not isinstance(value, (list, tuple)):
        return [value] * n
    if not isinstance(value, (list, tuple)):
        raise KeyeInputError(f"{name} must be a list with one entry per response (got {type(value).__name__})")
    if len(value) != n:
        raise KeyeInputError(f"{name} has {len(value)} entries for {n} responses")
    return list(value)


def score_batch(
    responses: Sequence[Any],
    references: Sequence[Any] | None = None,
    tasks: str | Sequence[str | None] | None = None,
    modes: str | Sequence[str | None] | None = None,
    spec: RewardSpec | None = None,
    **extras: Sequence[Any],
) -> list[RewardResult]:
    """Score a batch (list in, list out, same order), e.g. the G + M responses of RL groups.

    ``references`` is a list (one per response; None = all None). ``tasks`` / ``modes`` are a list or one
    value for every response. Each extra is a list/tuple with one entry per response (TRL-style dataset
    columns) or any other value shared by all responses; entry ``i`` is passed to ``score`` for response ``i``.

    Raises:
        KeyeInputError: a list of the wrong length, or the errors of ``score``; the message names the index.
    """
    n = len(responses)
    refs = [None] * n if references is None else _per_sample("references", references, n, broadcast=False)
    task_list = _per_sample("tasks", tasks, n, broadcast=True)
    mode_list = _per_sample("modes", modes, n, broadcast=True)
    columns = {k: _per_sample(k, v, n, broadcast=True) for k, v in extras.items()}
    spec = spec if spec is not None else _default_spec()
    out = []
    for i in range(n):
        sample_extra = {k: col[i] for k, col in columns.items()}
        try:
            out.append(score(responses[i], refs[i], task_list[i], mode_list[i], spec, **sample_extra))
        except KeyeInputError as err:
            raise KeyeInputError(err.reason, item=i) from err
    return out


def aggregate_stats(results: Sequence[RewardResult], prefix: str = "reward/") -> dict[str, float]:
    """Per-part statistics for logging: ``{prefix}{name}/{mean,std,min,max,frac}`` and the same for ``total``.

    ``mean``/``std``/``min``/``max`` are over the samples where the part applied (population std);
    ``frac`` is the share of samples where it applied. Also ``{prefix}count`` and ``{prefix}math_timeouts``
    (samples whose math check timed out). Empty input gives ``{prefix}count = 0`` only.
    """
    stats: dict[str, float] = {f"{prefix}count": float(len(results))}
    if not results:
        return stats
    columns: dict[str, list[float]] = {"total": [r.total for r in results]}
    for r in results:
        for name, value in r.parts.items():
            columns.setdefault(name, []).append(value)
    for name, values in columns.items():
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / len(values)
        stats[f"{prefix}{name}/mean"] = mean
        stats[f"{prefix}{name}/std"] = math.sqrt(var)
        stats[f"{prefix}{name}/min"] = min(values)
        stats[f"{prefix}{name}/max"] = max(values)
        stats[f"{prefix}{name}/frac"] = len(values) / len(results)
    stats[f"{prefix}math_timeouts"] = float(sum(1 for r in results if r.info.get("accuracy") == "timeout"))
    return stats
