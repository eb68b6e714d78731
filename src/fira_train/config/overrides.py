"""Config <-> dict (``OUT/config.json``) and ``section.field=value`` overrides (the CLI's).

:func:`apply_overrides` parses each value with the type of its dataclass field (ints, floats,
bools, strings, ``none`` for optional fields, comma-separated tuples), rebuilds the config (so
every ``__post_init__`` check runs again) and rejects unknown keys with the list of valid ones.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Union

from fira_train.config.run_config import ModelConfig, OptimConfig, RunConfig, TrainConfig
from fira_train.data.spec import DataSpec

SECTIONS = ("model", "optim", "data", "train")
KINDS: dict[str, type] = {"model": ModelConfig, "optim": OptimConfig, "data": DataSpec, "train": TrainConfig}


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    """A JSON-ready dict (tuples become lists)."""
    return dataclasses.asdict(config)


def flat_config(config: RunConfig) -> dict[str, Any]:
    """``{"section.key": value}`` of every setting (the keys overrides name)."""
    return {f"{section}.{key}": value for section, values in config_to_dict(config).items()
            if isinstance(values, dict) for key, value in values.items()}


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The keys whose values differ between two flat settings dicts (one missing counts), sorted."""
    return sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))


def describe_changed(old: Mapping[str, Any], new: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``"train.steps=5 (now 10), ..."``: each key with its old and its new value."""
    return ", ".join(f"{key}={old.get(key)!r} (now {new.get(key)!r})" for key in keys)


def _section_from_dict(kind: type, values: dict[str, Any], prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ValueError(f"{prefix} must be a mapping, got {values!r}")
    names = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown config key {prefix}.{unknown[0]}; valid keys: "
                         + ", ".join(f"{prefix}.{n}" for n in sorted(names)))
    hints = typing.get_type_hints(kind)
    converted = {}
    for key, value in values.items():
        if isinstance(value, list) and _is_tuple_type(hints[key]):
            value = tuple(value)
        converted[key] = value
    return kind(**converted)


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    """Inverse of :func:`config_to_dict`; rejects unknown keys and re-validates every field."""
    if not isinstance(values, dict):
        raise ValueError(f"a config must be a mapping, got {values!r}")
    unknown = sorted(set(values) - {"recipe", *SECTIONS})
    if unknown:
        raise ValueError(f"unknown config key {unknown[0]}; valid keys: recipe, " + ", ".join(SECTIONS))
    sections = {name: _section_from_dict(KINDS[name], values.get(name, {}), name) for name in SECTIONS}
    return RunConfig(recipe=values.get("recipe", "custom"), **sections)


def _is_tuple_type(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


def _optional_inner(hint: Any) -> Any | None:
    """X for ``X | None`` / ``Optional[X]``, else None."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_value(key: str, text: str, hint: Any) -> Any:
    """Parse the string ``text`` as a value of type ``hint`` for the field ``key``."""
    inner = _optional_inner(hint)
    if inner is not None:
        if text.strip().lower() in ("none", "null"):
            return None
        return parse_value(key, text, inner)
    try:
        if hint is bool:
            lowered = text.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint is str:
            return text
        if _is_tuple_type(hint):
            item_types = typing.get_args(hint)
            parts = [p for p in text.replace("(", "").replace(")", "").split(",") if p.strip()]
            if len(parts) != len(item_types):
                raise ValueError
            return tuple(parse_value(key, p.strip(), t) for p, t in zip(parts, item_types))
    except ValueError:
        raise ValueError(f"cannot parse {key}={text!r} as {_type_name(hint)}") from None
    raise TypeError(f"no parser for {key} of type {hint!r}")


def _type_name(hint: Any) -> str:
    if _is_tuple_type(hint):  # "tuple" alone said neither how many values nor how they are written
        items = typing.get_args(hint)
        return f"{len(items)} comma-separated values ({', '.join(_type_name(t) for t in items)})"
    return getattr(hint, "__name__", None) or str(hint)


def apply_overrides(config: RunConfig, overrides: list[str] | dict[str, str]) -> RunConfig:
    """A new config with ``section.field=value`` overrides applied (and validated).

    ``overrides`` is a list of ``"key=value"`` strings (the CLI form) or a ``{key: value}``
    dict of strings. Values are parsed with the field's type: ints, floats, bools
    (true/false/1/0/yes/no), strings, ``none`` for optional fields, comma-separated tuples
    (``optim.betas=0.9,0.95``). An unknown key raises ``ValueError`` listing the valid keys;
    so does ``recipe=NAME`` (a recipe is chosen with ``--recipe`` / :func:`~fira_train.config.recipes.get_recipe`).
    """
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} is not of the form section.field=value")
            items.append((override_key(item), item.partition("=")[2]))
    values = config_to_dict(config)
    for key, text in items:
        if key == "recipe":  # it would relabel the config without changing a single field
            raise ValueError(f"recipe={text} is not an override: choose the recipe with --recipe {text} "
                             "(an override changes one section.field; the recipe sets them all)")
        section, _, name = key.partition(".")
        if section not in KINDS or not name:
            raise ValueError(f"unknown config key {key!r}; keys look like section.field with section "
                             f"one of {', '.join(SECTIONS)} (e.g. train.steps=100)")
        hints = typing.get_type_hints(KINDS[section])
        if name not in hints or name not in {f.name for f in dataclasses.fields(KINDS[section])}:
            valid = ", ".join(f"{section}.{f.name}" for f in dataclasses.fields(KINDS[section]))
            raise ValueError(f"unknown config key {key!r}; valid keys: {valid}")
        values[section][name] = parse_value(key, text, hints[name])
    return config_from_dict(values)


def override_key(item: str) -> str:
    """The ``section.field`` of a ``key=value`` override, as :func:`apply_overrides` reads it."""
    return item.partition("=")[0].strip()


def flags_given(args: Any, keys: dict[str, str]) -> dict[str, tuple[str, Any]]:
    """``{config key: (flag, value)}`` of the flags given on a command line: ``keys`` maps an
    argparse dest to its key (``{"steps": "train.steps"}``); a flag left out (None) is absent."""
    return {key: (f"--{dest.replace('_', '-')}", getattr(args, dest)) for dest, key in keys.items()
            if getattr(args, dest, None) is not None}


def apply_command_line(config: RunConfig, flags: dict[str, tuple[str, Any]], overrides: Sequence[str]) -> RunConfig:
    """``config`` with a command line's settings: the flags given (``flags``: key -> ``(flag,
    value)``, from :func:`flags_given`), then the ``key=value`` overrides. An override of a key a
    flag gives too is a ValueError: which one won would depend on nothing written, as argparse
    keeps no order between the two. So are two overrides of one key with different values (the
    later one replaced the other silently; the same value twice changes nothing)."""
    refuse_repeated_overrides(overrides)
    for item in overrides:
        key = override_key(item)
        if key in flags:
            flag, value = flags[key]
            raise ValueError(f"{key} is given twice, by {flag} {value} and by the override {item.strip()!r}: "
                             "give it once")
    config = apply_overrides(config, {key: str(value) for key, (_, value) in flags.items()})
    return apply_overrides(config, list(overrides))


def refuse_repeated_overrides(overrides: Sequence[str]) -> None:
    """ValueError for a key that two of ``overrides`` give different values (as parsed:
    ``train.steps=5`` and ``train.steps=05`` agree), naming both."""
    first: dict[str, str] = {}
    for item in overrides:
        key = override_key(item)
        if key in first and _parsed(key, first[key]) != _parsed(key, item):
            raise ValueError(f"{key} is given twice, by the overrides {first[key].strip()!r} and {item.strip()!r}: "
                             "give it once")
        first.setdefault(key, item)


def _parsed(key: str, item: str) -> Any:
    """The value of the override ``item`` of ``key`` as its field's type reads it; the text where
    it does not parse (:func:`apply_overrides` names that error)."""
    text = item.partition("=")[2]
    section, _, name = key.partition(".")
    hint = typing.get_type_hints(KINDS[section]).get(name) if section in KINDS else None
    try:
        return text.strip() if hint is None else parse_value(key, text, hint)
    except (ValueError, TypeError):
        return text.strip()


def refuse_overrides(overrides: Sequence[str], keys: Sequence[str], setter: str) -> None:
    """ValueError for an override of one of ``keys``: a setting the command sets itself (``setter``
    says how, e.g. ``"sweep sets it with --lrs, --seeds, --out"``), which would silently replace it."""
    for item in overrides:
        key = override_key(item)
        if key in keys:
            raise ValueError(f"{key}: {setter}; drop the override {item!r}")


def override_keys() -> list[str]:
    """Every ``section.field`` key that :func:`apply_overrides` accepts."""
    return [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(KINDS[s])]
