"""The reward registry and the per-sample context every reward function receives.

A reward function has the signature ``fn(ctx: RewardContext) -> float | None``: it returns the part's value,
or ``None`` when the part does not apply to this sample (it is then left out of ``parts`` and of the total).
Register one with::

    @register_reward("politeness", low=0.0, high=1.0)
    def politeness(ctx):
        return 1.0 if "please" in ctx.answer.lower() else 0.0

and name it in a config (``rewards: [format, accuracy, politeness]``) or in ``RewardSpec(custom={...})``.
Returned values are clipped into ``[low, high]``; NaN becomes ``low``. Exceptions raised by a user reward
propagate (built-in rewards never raise on any response string).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from keye.errors import KeyeConfigError
from keye.rewards import text as _text

if TYPE_CHECKING:
    from keye.rewards.format import Structure
    from keye.rewards.spec import RewardSpec

RewardFn = Callable[["RewardContext"], "float | None"]


@dataclass(frozen=True)
class RewardInfo:
    """A registered reward: its function and the closed range ``[low, high]`` its values are clipped to."""

    name: str
    fn: RewardFn
    low: float
    high: float
    builtin: bool = False


_REGISTRY: dict[str, RewardInfo] = {}


@dataclass
class RewardContext:
    """Everything a reward function may look at for one sample.

    Attributes:
        response: the raw model response (already coerced to ``str``).
        reference: the ground truth (str / number / list / dict / None), task-dependent.
        task: "mc", "numeric", "math", "text", "list", "json" or "none" (already resolved).
        mode: requested thinking mode, "think", "no_think", "auto" or None (= not checked).
        spec: the active ``RewardSpec``.
        extra: per-sample extras (``choices``, ``precision``, ``tolerance``, ``instructions``,
            ``num_tokens``, ``prompt``, and anything a custom reward wants).
        info: free-form diagnostics a reward may add (strings), returned in ``RewardResult.info``.
    """

    response: str
    reference: Any
    task: str
    mode: str | None
    spec: RewardSpec
    extra: dict[str, Any]
    info: dict[str, str] = field(default_factory=dict)

    @cached_property
    def structure(self) -> Structure:
        """The parsed tag structure of the response (see ``keye.rewards.format.parse_structure``)."""
        from keye.rewards.format import parse_structure

        return parse_structure(self.response)

    @cached_property
    def answer(self) -> str:
        """The final answer as KeyeChat post-processing extracts it (boxed content, last answer block)."""
        return _text.final_answer(self.response)

    @cached_property
    def visible(self) -> str:
        """The visible answer (reasoning dropped, last ``<answer>`` block), without boxed extraction."""
        return _text.visible_answer(self.response)


def register_reward(
    name: str, *, low: float = 0.0, high: float = 1.0, replace: bool = False
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn(ctx: RewardContext) -> float | None`` under ``name``.

    Args:
        name: the name used in configs and in ``RewardResult.parts``.
        low, high: the documented range; returned values are clipped into it (finite, ``low <= high``).
        replace: allow re-registering an existing custom name (built-in names can never be replaced).

    Raises:
        KeyeConfigError: empty/duplicate name, a built-in name, or a bad range.
    """
    if not isinstance(name, str) or not name.strip():
        raise KeyeConfigError(f"reward name must be a non-empty string, got {name!r}")
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise KeyeConfigError(f"reward {name!r}: range [{low}, {high}] must be finite with low <= high")

    def decorator(fn: RewardFn) -> RewardFn:
        existing = _REGISTRY.get(name)
        if existing is not None and (existing.builtin or not replace):
            raise KeyeConfigError(f"reward {name!r} is already registered" + (" (built-in)" if existing.builtin else ""))
        _REGISTRY[name] = RewardInfo(name, fn, float(low), float(high))
        return fn

    return decorator


def _register_builtin(name: str, fn: RewardFn, low: float, high: float) -> None:
    _REGISTRY[name] = RewardInfo(name, fn, float(low), float(high), builtin=True)


def unregister_reward(name: str) -> None:
    """Remove a custom reward (mainly for tests); built-ins cannot be removed (``KeyeConfigError``)."""
    info = _REGISTRY.get(name)
    if info is None:
        raise KeyeConfigError(f"reward {name!r} is not registered; known rewards: {sorted(_REGISTRY)}")
    if info.builtin:
        raise KeyeConfigError(f"built-in reward {name!r} cannot be unregistered")
    del _REGISTRY[name]


def get_reward(name: str) -> RewardInfo:
    """The registered reward ``name``; ``KeyeConfigError`` listing the known names if there is none."""
    _ensure_builtins()
    info = _REGISTRY.get(name)
    if info is None:
        raise KeyeConfigError(f"unknown reward {name!r}; known rewards: {sorted(_REGISTRY)}")
    return info


def known_rewards() -> list[str]:
    """Names of every registered reward (built-ins first, then custom ones in registration order)."""
    _ensure_builtins()
    return list(_REGISTRY)


def _ensure_builtins() -> None:
    # The built-in parts live in modules that import this one; load them on first use.
    if "format" not in _REGISTRY:
        import keye.rewards.builtins  # noqa: F401
