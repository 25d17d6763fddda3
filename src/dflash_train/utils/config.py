"""Typed dataclass configs: YAML in, validated objects out, every field overridable.

A job declares its config as (nested) dataclasses whose `__post_init__` validates
values. This module turns a YAML file plus command-line overrides into such an object:

    cfg = load_config(TrainConfig, "run.yaml", overrides={"optim.lr": "3e-4"})

Unknown keys are errors that name the key and the file (a typo must never be silently
ignored), and values are coerced to the declared field types so `--optim.lr 3e-4`
works the same as `lr: 3.0e-4` in YAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key is invalid; the message names where it came from."""


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert `value` (from YAML or a command-line string) to type `tp`."""
    inner, optional = _strip_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional or tp is Any:
            return None
        raise ConfigError(f"{where}: a value is required (got null)")
    if _is_dataclass_type(inner):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {inner.__name__}, got {value!r}")
        return from_dict(inner, value, where=where)
    origin = typing.get_origin(inner)
    if inner is Any:
        return value
    if origin is typing.Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}")
        return value
    if inner is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if inner in (int, float, str):
        if inner is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if inner is int and isinstance(value, str):
            try:
                return int(float(value)) if "e" in value.lower() else int(value)
            except ValueError:
                raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
        try:
            return inner(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {inner.__name__}, got {value!r}") from None
    if origin in (list, tuple):
        if isinstance(value, str):
            loaded = yaml.safe_load(value)
            value = loaded if isinstance(loaded, list) else [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(inner)
        elem = args[0] if args else Any
        out = [_coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict or inner is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return dict(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], *, where: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys and bad values raise ConfigError."""
    fields = _field_types(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys{' under ' + where if where else ''}: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, fields[name], f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or cls.__name__}: {exc}") from None


def to_dict(obj: Any) -> Any:
    """Plain (YAML/JSON-ready) form of a dataclass config."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def leaf_fields(cls: type, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted name, type, help) for every leaf field of a nested dataclass."""
    out = []
    for f in dataclasses.fields(cls):
        tp = _field_types(cls)[f.name]
        inner, _ = _strip_optional(tp)
        name = f"{prefix}{f.name}"
        if _is_dataclass_type(inner):
            out.extend(leaf_fields(inner, prefix=f"{name}."))
        else:
            out.append((name, tp, f.metadata.get("help", "")))
    return out


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """`--config FILE` plus one `--a.b VALUE` option per leaf field of `cls`."""
    parser.add_argument("--config", type=Path, default=None, help="YAML config file")
    group = parser.add_argument_group("config overrides (any field of the config file)")
    for name, tp, help_text in leaf_fields(cls):
        group.add_argument(
            f"--{name}",
            dest=f"cfg__{name}",
            default=argparse.SUPPRESS,
            metavar=getattr(_strip_optional(tp)[0], "__name__", "VALUE").upper(),
            help=help_text or None,
        )


def overrides_from_args(args: argparse.Namespace) -> dict[str, str]:
    return {k[len("cfg__"):]: v for k, v in vars(args).items() if k.startswith("cfg__")}


def load_config(
    cls: type[T], path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> T:
    """YAML file (optional) + dotted overrides -> validated `cls`. Errors name the file."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded or {}
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path else str(exc)) from None
