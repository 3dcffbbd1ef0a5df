"""``RewardSpec``: per-part weights and options of the rule-based reward, and its config schema.

A recipe names its rewards in YAML in any of these forms (weights default to 1.0)::

    rewards: [format, accuracy, json]
    rewards: {format: 0.5, accuracy: 1.0, repetition: 0.5}
    rewards: [format, {accuracy: 2.0}, {name: overlong, weight: 1.0}]
    options: {overlong_max_len: 3072, overlong_buffer: 512}     # optional; options may also sit at top level

Names are the built-in parts (fields of :class:`RewardSpec`) or rewards registered with
:func:`keye.rewards.register_reward`; any other name raises ``KeyeConfigError`` listing the known ones.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError

#: Built-in parts, in the order they are computed and reported.
BUILTIN_PARTS = (
    "format",
    "accuracy",
    "json",
    "code",
    "markdown",
    "steps",
    "length",
    "repetition",
    "overlong",
)

_MARKDOWN_KINDS = ("list", "table")
_MATH_BACKENDS = ("process", "inline")


@dataclass
class RewardSpec:
    """Weights of the reward parts plus the options that parametrise them.

    Weights (``total = sum(weight * part)`` over the parts that apply to a sample; weight 0 = not computed):
        format: think / no-think / auto-think structure and requested-mode check, part in [0, 1].
        accuracy: answer correctness, part in [0, 1] (or {-1, +1} with ``accuracy_pm1``).
        json, code, markdown, steps, length: instruction-format checks, each part in {0, 1}.
        repetition: repeated n-grams / lines / trailing loops, part in [-1, 0].
        overlong: DAPO soft overlong penalty, part in [-1, 0] (the weight is DAPO's penalty factor).
        custom: weights of rewards registered with ``register_reward``, by name.

    Options (all validated in ``__post_init__``; bad values raise ``KeyeConfigError``):
        accuracy_pm1: score accuracy +1 / -1 (RLEP's verifier) instead of 1 / 0.
        numeric_rel_tol, numeric_abs_tol: numeric answers match when ``|p - g| <= max(abs, rel * |g|)``.
        numeric_precision: when set, numbers match when both round to the same value at this many decimals
            (MathVista's float rule); a per-sample ``precision=`` extra overrides it.
        math_timeout_s: hard wall-clock limit of one math-verify comparison, seconds (> 0).
        math_backend: "process" (a killable worker process; works from any thread) or "inline" (this
            process with math-verify's SIGALRM timeout; only on the main thread, else falls back to process).
        math_cache_size: entries of the (gold, prediction) -> verdict LRU cache (0 disables it).
        math_max_chars: longer predicted answers are not sent to math-verify (string match only).
        answer_tail_chars: multiple-choice / numeric parsers read only this many trailing answer characters.
        require_answer_tag: format requires the answer inside ``<answer>...</answer>``.
        require_boxed: format requires a non-empty, balanced ``\\boxed{...}`` in the answer.
        auto_requires_analysis: in auto mode the response must open with ``<analysis>...</analysis>``.
        allow_empty_think_in_no_think: an empty ``<think></think>`` block is accepted in no-think mode.
        json_schema: default JSON schema for the ``json`` part (None = any JSON object or array).
        code_language: default language of the fenced block for ``code`` (None = any language).
        markdown_kind: default structure for the ``markdown`` part: "list" or "table".
        markdown_min_items: a markdown list needs at least this many consecutive items.
        steps_min, steps_max: default window of reasoning steps for ``steps`` (max None = unbounded).
        length_min, length_max: default window of answer words for ``length`` (max None = unbounded).
        repetition_ngram: n of the n-gram duplicate ratio.
        repetition_threshold: duplicate n-gram / line ratio tolerated before any penalty, in [0, 1).
        repetition_min_tokens: responses with fewer tokens get no n-gram / loop penalty.
        loop_max_period, loop_min_repeats: a trailing loop is a block of <= max_period tokens repeated at
            least min_repeats times at the end of the response.
        overlong_max_len, overlong_buffer: DAPO's L_max and L_buf, in tokens (``num_tokens=`` extra) or,
            without it, in estimated tokens (characters / 4).
        max_chars: repetition and step counting read at most this many trailing characters (JSON answers
            and Python/JSON code blocks longer than 200,000 characters are never parsed and fail their check).
    """

    format: float = 1.0
    accuracy: float = 1.0
    json: float = 0.0
    code: float = 0.0
    markdown: float = 0.0
    steps: float = 0.0
    length: float = 0.0
    repetition: float = 0.0
    overlong: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)

    accuracy_pm1: bool = False
    numeric_rel_tol: float = 1e-6
    numeric_abs_tol: float = 1e-9
    numeric_precision: int | None = None
    math_timeout_s: float = 5.0
    math_backend: str = "process"
    math_cache_size: int = 8192
    math_max_chars: int = 1000
    answer_tail_chars: int = 4096
    require_answer_tag: bool = False
    require_boxed: bool = False
    auto_requires_analysis: bool = True
    allow_empty_think_in_no_think: bool = True
    json_schema: dict | None = None
    code_language: str | None = None
    markdown_kind: str = "list"
    markdown_min_items: int = 2
    steps_min: int = 1
    steps_max: int | None = None
    length_min: int = 0
    length_max: int | None = None
    repetition_ngram: int = 6
    repetition_threshold: float = 0.1
    repetition_min_tokens: int = 32
    loop_max_period: int = 64
    loop_min_repeats: int = 4
    overlong_max_len: int = 3072
    overlong_buffer: int = 512
    max_chars: int = 200_000

    def __post_init__(self) -> None:
        self.validate()

    # -- weights ---------------------------------------------------------------------------------------------
    def weights(self) -> dict[str, float]:
        """Non-zero weights by part name: built-ins in ``BUILTIN_PARTS`` order, then custom rewards."""
        out = {name: float(getattr(self, name)) for name in BUILTIN_PARTS if getattr(self, name) != 0}
        out.update({k: float(v) for k, v in self.custom.items() if v != 0})
        return out

    def validate(self) -> None:
        """Check every weight and option; raise ``KeyeConfigError`` naming the first bad field."""
        for name in BUILTIN_PARTS:
            _check_weight(name, getattr(self, name))
        if not isinstance(self.custom, dict):
            raise KeyeConfigError(f"RewardSpec.custom must be a dict of name -> weight, got {self.custom!r}")
        from keye.rewards.registry import known_rewards  # local: registry imports this module

        known = known_rewards()
        for name, weight in self.custom.items():
            if name in BUILTIN_PARTS or name not in known:
                raise KeyeConfigError(
                    f"unknown custom reward {name!r}; registered custom rewards: "
                    f"{sorted(set(known) - set(BUILTIN_PARTS)) or 'none'}"
                )
            _check_weight(name, weight)
        for name in ("accuracy_pm1", "require_answer_tag", "require_boxed", "auto_requires_analysis",
                     "allow_empty_think_in_no_think"):
            if not isinstance(getattr(self, name), bool):
                raise KeyeConfigError(f"reward option {name} must be true or false, got {getattr(self, name)!r}")
        if self.math_backend not in _MATH_BACKENDS:
            raise KeyeConfigError(f"math_backend must be one of {_MATH_BACKENDS}, got {self.math_backend!r}")
        if self.markdown_kind not in _MARKDOWN_KINDS:
            raise KeyeConfigError(f"markdown must be one of {_MARKDOWN_KINDS}, got {self.markdown_kind!r}")
        _check_number("math_timeout_s", self.math_timeout_s, low=1e-3)
        _check_number("numeric_rel_tol", self.numeric_rel_tol, low=0.0)
        _check_number("numeric_abs_tol", self.numeric_abs_tol, low=0.0)
        _check_number("repetition_threshold", self.repetition_threshold, low=0.0, high=0.999)
        for name in (
            "math_cache_size",
            "length_min",
            "steps_min",
        ):
            _check_int(name, getattr(self, name), low=0)
        for name in (
            "math_max_chars",
            "answer_tail_chars",
            "markdown_min_items",
            "repetition_ngram",
            "repetition_min_tokens",
            "loop_max_period",
            "overlong_buffer",
            "max_chars",
        ):
            _check_int(name, getattr(self, name), low=1)
        _check_int("loop_min_repeats", self.loop_min_repeats, low=2)
        _check_int("overlong_max_len", self.overlong_max_len, low=self.overlong_buffer)
        if self.numeric_precision is not None:
            _check_int("numeric_precision", self.numeric_precision, low=0)
        if self.steps_max is not None:
            _check_int("steps_max", self.steps_max, low=self.steps_min)
        if self.length_max is not None:
            _check_int("length_max", self.length_max, low=self.length_min)
        if self.json_schema is not None:
            from keye.rewards.instruct import compile_schema

            compile_schema(self.json_schema, where="RewardSpec.json_schema")
        if self.code_language is not None and not isinstance(self.code_language, str):
            raise KeyeConfigError(f"code_language must be a string or None, got {self.code_language!r}")

    # -- (de)serialisation ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A plain dict that ``from_dict`` turns back into an equal spec: ``{"rewards": {...}, "options": {...}}``."""
        options = {}
        for f in dataclasses.fields(self):
            if f.name in BUILTIN_PARTS or f.name == "custom":
                continue
            options[f.name] = getattr(self, f.name)
        return {"rewards": self.weights(), "options": options}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RewardSpec:
        """Build a spec from a config mapping (see the module docstring for the accepted forms).

        Parts not named under ``rewards`` get weight 0. Without a ``rewards`` key the defaults
        (format 1, accuracy 1) are kept. Unknown reward names or option keys raise ``KeyeConfigError``.
        """
        if not isinstance(d, dict):
            raise KeyeConfigError(f"a reward config must be a mapping, got {type(d).__name__}")
        d = dict(d)
        options = dict(d.pop("options", None) or {})
        rewards = d.pop("rewards", None)
        overlap = set(options) & set(d)
        if overlap:
            raise KeyeConfigError(f"reward options given twice (top level and under 'options'): {sorted(overlap)}")
        options.update(d)
        weights = None if rewards is None else _parse_rewards(rewards)
        valid = {f.name for f in dataclasses.fields(cls)} - set(BUILTIN_PARTS) - {"custom"}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise KeyeConfigError(f"unknown reward option(s) {unknown}; valid options: {sorted(valid)}")
        kwargs: dict[str, Any] = dict(options)
        if weights is not None:
            for name in BUILTIN_PARTS:
                kwargs[name] = weights.pop(name, 0.0)
            kwargs["custom"] = weights
        try:
            return cls(**kwargs)
        except TypeError as err:  # a non-keyword problem the field checks cannot see
            raise KeyeConfigError(f"invalid reward config: {err}") from err

    @classmethod
    def from_yaml(cls, path: str | Path) -> RewardSpec:
        """Read a spec from a YAML file; the mapping may sit at top level or under a ``reward:`` key."""
        import yaml

        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except OSError as err:
            raise KeyeConfigError(f"{p}: cannot read reward config: {err}") from err
        except yaml.YAMLError as err:
            raise KeyeConfigError(f"{p}: invalid YAML: {err}") from err
        if isinstance(data, dict) and isinstance(data.get("reward"), dict):
            data = data["reward"]
        try:
            return cls.from_dict(data)
        except KeyeConfigError as err:
            raise KeyeConfigError(f"{p}: {err}") from err


def _parse_rewards(rewards: Any) -> dict[str, float]:
    from keye.rewards.registry import known_rewards

    if isinstance(rewards, str):
        rewards = [rewards]
    items: list[tuple[str, Any]] = []
    if isinstance(rewards, dict):
        items = list(rewards.items())
    elif isinstance(rewards, (list, tuple)):
        for entry in rewards:
            if isinstance(entry, str):
                items.append((entry, 1.0))
            elif isinstance(entry, dict) and "name" in entry:
                extra = set(entry) - {"name", "weight"}
                if extra:
                    raise KeyeConfigError(f"reward entry {entry!r} has unknown keys {sorted(extra)}")
                items.append((entry["name"], entry.get("weight", 1.0)))
            elif isinstance(entry, dict) and len(entry) == 1:
                items.extend(entry.items())
            else:
                raise KeyeConfigError(
                    f"reward entry {entry!r} must be a name, {{name: weight}} or {{name: ..., weight: ...}}"
                )
    else:
        raise KeyeConfigError(f"'rewards' must be a list or a mapping, got {type(rewards).__name__}")
    known = known_rewards()
    out: dict[str, float] = {}
    for name, weight in items:
        if not isinstance(name, str) or name not in known:
            raise KeyeConfigError(f"unknown reward {name!r}; known rewards: {sorted(known)}")
        if name in out:
            raise KeyeConfigError(f"reward {name!r} is listed twice")
        _check_weight(name, weight)
        out[name] = float(weight)
    return out


def _check_weight(name: str, weight: Any) -> None:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
        raise KeyeConfigError(f"weight of reward {name!r} must be a finite number, got {weight!r}")


def _check_number(name: str, value: Any, low: float | None = None, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise KeyeConfigError(f"reward option {name} must be a finite number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise KeyeConfigError(f"reward option {name}={value!r} is outside [{low}, {high}]")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise KeyeConfigError(f"reward option {name} must be an integer >= {low}, got {value!r}")
