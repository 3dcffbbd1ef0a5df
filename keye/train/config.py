"""Typed recipe configs: nested dataclasses <-> YAML, with dot-list overrides from the command line.

A recipe declares its config as nested dataclasses with defaults. ``load_config(Cls, "x.yaml",
["optim.lr=1e-4", "model.path=/ckpt"])`` reads the YAML (unknown keys are errors naming the key and
the file), applies each ``dotted.key=value`` override (values parsed as YAML scalars, so ``1e-4``,
``true``, ``[1, 2]`` and ``null`` work) and type-checks the result against the annotations.
``dump_config`` writes the resolved config back as YAML for the run folder.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from keye.errors import KeyeConfigError

T = TypeVar("T")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if hint is Any or hint is typing.Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except KeyeConfigError as err:
                errors.append(str(err))
        raise KeyeConfigError(f"{where}: {value!r} matches none of {hint}")
    if origin is typing.Literal:
        if value not in get_args(hint):
            raise KeyeConfigError(f"{where}: {value!r} is not one of {list(get_args(hint))}")
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise KeyeConfigError(f"{where}: expected a mapping for {hint.__name__}, got {value!r}")
        return from_dict(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise KeyeConfigError(f"{where}: expected a list, got {value!r}")
        args = get_args(hint)
        item = args[0] if args else Any
        out = [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise KeyeConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    if hint is float:
        if isinstance(value, str):
            # PyYAML reads "1e-4" (no dot) as a string; accept any float literal.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KeyeConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise KeyeConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise KeyeConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise KeyeConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], where: str = "config") -> T:
    """Build dataclass ``cls`` from a (nested) dict; unknown keys and type mismatches raise
    :class:`KeyeConfigError` naming the dotted key."""
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise KeyeConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """A dataclass (recursively) as plain dicts/lists for YAML/JSON."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` strings to a nested dict (values parsed as YAML)."""
    for item in overrides:
        if "=" not in item:
            raise KeyeConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise KeyeConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = value
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Defaults of ``cls`` <- YAML file (optional) <- dot-list overrides; returns a typed instance."""
    data = to_dict(cls())
    where = "config"
    if path is not None:
        path = Path(path)
        where = str(path)
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except FileNotFoundError:
            raise KeyeConfigError(f"{path}: config file not found") from None
        except yaml.YAMLError as err:
            raise KeyeConfigError(f"{path}: invalid YAML ({err})") from None
        if not isinstance(loaded, dict):
            raise KeyeConfigError(f"{path}: top level must be a mapping")
        _deep_update(data, loaded, where)
    apply_overrides(data, overrides or [])
    return from_dict(cls, data, where)


def _deep_update(base: dict[str, Any], new: dict[str, Any], where: str) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_update(base[k], v, f"{where}.{k}")
        else:
            base[k] = v


def dump_config(cfg: Any, path: str | Path) -> None:
    """Write the resolved config as YAML."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
