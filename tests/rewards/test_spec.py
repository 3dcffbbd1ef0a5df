"""RewardSpec config schema, YAML round trip and the reward registry."""

from __future__ import annotations

import math

import pytest

from keye.errors import KeyeConfigError, KeyeInputError
from keye.rewards import RewardSpec, get_reward, known_rewards, register_reward, score
from keye.rewards.registry import unregister_reward


def test_rewards_list_sets_named_weights_and_zeroes_the_rest() -> None:
    spec = RewardSpec.from_dict({"rewards": ["format", "accuracy", "json"]})
    assert spec.weights() == {"format": 1.0, "accuracy": 1.0, "json": 1.0}


def test_rewards_mapping_and_mixed_list_forms() -> None:
    a = RewardSpec.from_dict({"rewards": {"format": 0.5, "repetition": 0.25}})
    assert a.weights() == {"format": 0.5, "repetition": 0.25}
    b = RewardSpec.from_dict({"rewards": ["format", {"accuracy": 2.0}, {"name": "overlong", "weight": 1.0}]})
    assert b.weights() == {"format": 1.0, "accuracy": 2.0, "overlong": 1.0}


def test_options_top_level_or_nested() -> None:
    a = RewardSpec.from_dict({"rewards": ["overlong"], "overlong_max_len": 4096})
    b = RewardSpec.from_dict({"rewards": ["overlong"], "options": {"overlong_max_len": 4096}})
    assert a == b and a.overlong_max_len == 4096
    with pytest.raises(KeyeConfigError, match="given twice"):
        RewardSpec.from_dict({"overlong_buffer": 1, "options": {"overlong_buffer": 2}})


def test_no_rewards_key_keeps_default_weights() -> None:
    assert RewardSpec.from_dict({"math_timeout_s": 2.0}).weights() == {"format": 1.0, "accuracy": 1.0}


def test_unknown_reward_name_lists_known_ones() -> None:
    with pytest.raises(KeyeConfigError) as err:
        RewardSpec.from_dict({"rewards": ["format", "acuracy"]})
    message = str(err.value)
    assert "acuracy" in message
    for name in ("format", "accuracy", "json", "repetition", "overlong"):
        assert name in message


@pytest.mark.parametrize(
    "config,match",
    [
        ({"rewards": ["format"], "options": {"no_such_option": 1}}, "unknown reward option"),
        ({"rewards": {"format": float("nan")}}, "finite number"),
        ({"rewards": {"format": "1"}}, "finite number"),
        ({"rewards": ["format", "format"]}, "listed twice"),
        ({"rewards": 3}, "list or a mapping"),
        ({"rewards": [{"name": "format", "weigth": 1}]}, "unknown keys"),
        ({"math_backend": "gpu"}, "math_backend"),
        ({"markdown_kind": "tree"}, "markdown"),
        ({"math_timeout_s": 0}, "math_timeout_s"),
        ({"repetition_threshold": 1.0}, "repetition_threshold"),
        ({"overlong_max_len": 100, "overlong_buffer": 512}, "overlong_max_len"),
        ({"steps_min": 3, "steps_max": 2}, "steps_max"),
        ({"json_schema": {"type": "no-such-type"}}, "invalid JSON schema"),
        ({"accuracy_pm1": "yes"}, "true or false"),
    ],
)
def test_bad_configs_raise_config_error(config: dict, match: str) -> None:
    with pytest.raises(KeyeConfigError, match=match):
        RewardSpec.from_dict(config)


def test_to_dict_round_trip_and_yaml(tmp_path) -> None:
    spec = RewardSpec(format=0.5, accuracy=1.0, repetition=0.5, overlong=1.0, accuracy_pm1=True,
                      json_schema={"type": "object"}, overlong_max_len=4096)
    assert RewardSpec.from_dict(spec.to_dict()) == spec
    path = tmp_path / "rl.yaml"
    path.write_text(
        "reward:\n  rewards: [format, {accuracy: 2.0}]\n  options:\n    accuracy_pm1: true\n    math_timeout_s: 3\n"
    )
    loaded = RewardSpec.from_yaml(path)
    assert loaded.weights() == {"format": 1.0, "accuracy": 2.0}
    assert loaded.accuracy_pm1 is True and loaded.math_timeout_s == 3


def test_yaml_errors_name_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("rewards: [format, nope]\n")
    with pytest.raises(KeyeConfigError, match="bad.yaml"):
        RewardSpec.from_yaml(bad)
    with pytest.raises(KeyeConfigError, match="missing.yaml"):
        RewardSpec.from_yaml(tmp_path / "missing.yaml")


def test_custom_reward_decorator_config_and_clipping() -> None:
    @register_reward("test_politeness", low=0.0, high=1.0)
    def politeness(ctx):
        return 2.0 if "please" in ctx.answer else float("nan")

    try:
        assert "test_politeness" in known_rewards()
        spec = RewardSpec.from_dict({"rewards": {"format": 1.0, "test_politeness": 0.5}})
        assert spec.custom == {"test_politeness": 0.5}
        hit = score("<think>r</think>\\boxed{please}", spec=spec, mode="think")
        assert hit.parts["test_politeness"] == 1.0  # 2.0 clipped to the declared high
        assert hit.total == pytest.approx(1.0 + 0.5 * 1.0)
        miss = score("<think>r</think>no", spec=spec, mode="think")
        assert miss.parts["test_politeness"] == 0.0  # NaN becomes the declared low
        assert "NaN" in miss.info["test_politeness"]
        with pytest.raises(KeyeConfigError, match="already registered"):
            register_reward("test_politeness")(politeness)
    finally:
        unregister_reward("test_politeness")
    assert "test_politeness" not in known_rewards()


def test_custom_reward_not_applicable_is_left_out() -> None:
    @register_reward("test_only_with_key", low=-1.0, high=1.0)
    def only_with_key(ctx):
        return None if "key" not in ctx.extra else -0.5

    try:
        spec = RewardSpec(format=0.0, accuracy=0.0, custom={"test_only_with_key": 2.0})
        assert score("x", spec=spec).parts == {}
        r = score("x", spec=spec, key=1)
        assert r.parts == {"test_only_with_key": -0.5} and r.total == -1.0
    finally:
        unregister_reward("test_only_with_key")


def test_builtin_names_are_protected() -> None:
    with pytest.raises(KeyeConfigError, match="built-in"):
        register_reward("format")(lambda ctx: 1.0)
    with pytest.raises(KeyeConfigError, match="built-in"):
        unregister_reward("format")
    with pytest.raises(KeyeConfigError, match="unknown reward"):
        get_reward("nope")
    with pytest.raises(KeyeConfigError, match="range"):
        register_reward("test_bad_range", low=1.0, high=0.0)
    with pytest.raises(KeyeConfigError, match="unknown custom reward"):
        RewardSpec(custom={"nope": 1.0})


def test_builtin_ranges_match_the_documentation() -> None:
    expected = {"format": (0, 1), "accuracy": (-1, 1), "json": (0, 1), "code": (0, 1), "markdown": (0, 1),
                "steps": (0, 1), "length": (0, 1), "repetition": (-1, 0), "overlong": (-1, 0)}
    for name, (low, high) in expected.items():
        info = get_reward(name)
        assert (info.low, info.high) == (low, high) and info.builtin
        assert math.isfinite(info.low)


def test_bad_arguments_raise_input_error() -> None:
    with pytest.raises(KeyeInputError, match="unknown task"):
        score("x", reference="1", task="sudoku")
    with pytest.raises(KeyeInputError, match="unknown thinking mode"):
        score("x", mode="ponder")
    with pytest.raises(KeyeInputError, match="num_tokens"):
        score("x", spec=RewardSpec(overlong=1.0), num_tokens=-3)
    with pytest.raises(KeyeInputError, match="instructions"):
        score("x", spec=RewardSpec(json=1.0), instructions=["json"])
    with pytest.raises(KeyeInputError, match="spec"):
        score("x", spec={"format": 1.0})


@pytest.mark.parametrize(
    "reference,task",
    [(None, "none"), ([1, 2], "list"), ({"a": 1}, "json"), (3, "numeric"), ("B", "mc"), ("-2.5", "numeric"),
     ("\\frac{1}{2}", "math"), ("x^2", "math"), ("Paris", "text")],
)
def test_task_inference(reference, task) -> None:
    from keye.rewards.accuracy import normalize_task

    assert normalize_task(None, reference) == task
