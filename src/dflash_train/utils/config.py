"""Typed dataclass configs for every job: YAML in, validated objects out, every field an option.

A job declares its config as (nested) dataclasses. Each field's help is the string literal
written under it (or `metadata={"help": ...}`); choices are `Literal[...]` types; ranges
and cross-field rules live in `__post_init__`. This module turns a YAML file plus
command-line options into such an object:

    cfg = load_config(TrainConfig, "run.yaml", overrides={"optim.lr": "3e-4"})

and reads the fields (`leaf_fields`) from which utils/config_cli.py builds a job's command line.

Unknown keys are errors that name the key and the file (a typo must never be silently
ignored); values are coerced to the declared types, so `--optim.lr 3e-4` works like
`lr: 3.0e-4` in YAML; floats must be finite and integers exact (`1.5e0` is not an int).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import math
import textwrap
import types
import typing
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import yaml

from dflash_train.utils.errors import ConfigError
from dflash_train.utils.fs import not_usable

log = logging.getLogger(__name__)
T = TypeVar("T")
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def cli(*, positional: bool = False, aliases: tuple[str, ...] = (), help: str | None = None) -> dict:
    """Field metadata for the command line: `field(default=..., metadata=cli(aliases=("-o",)))`."""
    out: dict[str, Any] = {"positional": positional, "aliases": tuple(aliases)}
    if help is not None:
        out["help"] = help
    return out


def refuse_unread(cfg: Any, section: str, defaults: dict[str, Any], switch: str, needed: str) -> None:
    """Refuse the fields of `cfg` (named in `defaults`) that are set away from their defaults while
    `cfg.<switch>` is not `needed`: the mode chosen never reads them, and a setting silently ignored
    would make a run differ from what its config says."""
    chosen = getattr(cfg, switch)
    changed = [name for name, default in defaults.items() if getattr(cfg, name) != default]
    if chosen == needed or not changed:
        return
    named = " and ".join(f"{section}.{name} ({getattr(cfg, name)!r})" for name in changed)
    verb, them = ("apply", "them") if len(changed) > 1 else ("applies", changed[0])
    raise ValueError(f"{named} {verb} to {section}.{switch} {needed}; {section}.{switch} is {chosen!r}: set "
                     f"{section}.{switch} {needed}, or leave {them} out")


# -- reading the config classes ----------------------------------------------------------------


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_option(f: dataclasses.Field) -> bool:
    """A field a config file or the command line sets; `metadata={"option": False}` marks one the
    program sets itself (from other options), never read from or written to a config."""
    return f.init and f.metadata.get("option", True)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if _is_option(f)}


def strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


@lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass (its help text), base classes included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class Leaf:
    name: str  # dotted
    type: Any
    help: str
    default: Any
    positional: bool
    aliases: tuple[str, ...]


def leaf_fields(cls: type, prefix: str = "") -> list[Leaf]:
    """Every leaf field of a nested dataclass config, with its dotted name and help."""
    out: list[Leaf] = []
    docs, types_ = field_docs(cls), _field_types(cls)
    for f in dataclasses.fields(cls):
        if not _is_option(f):
            continue
        tp = types_[f.name]
        inner, _ = strip_optional(tp)
        name = f"{prefix}{f.name}"
        if _is_dataclass_type(inner):
            out.extend(leaf_fields(inner, prefix=f"{name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        meta = f.metadata
        out.append(Leaf(name, tp, meta.get("help") or docs.get(f.name, ""), default,
                        bool(meta.get("positional")), tuple(meta.get("aliases", ()))))
    return out


# -- values --------------------------------------------------------------------------------------


def _listify(value: Any) -> Any:
    """A command-line list value: ["1,2,3"], ["[1, 2]"], "1,2", or a plain list."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and (
            "," in value[0] or value[0].strip().startswith("[")):
        value = value[0]
    if isinstance(value, str):
        loaded = yaml.safe_load(value) if value.strip().startswith("[") else None
        value = loaded if isinstance(loaded, list) else [v.strip() for v in value.split(",") if v.strip()]
    return value


def union_members(tp: Any) -> tuple[Any, ...]:
    """The members of a union that is not just `X | None` (`bool | Literal["auto"]`), else ()."""
    inner, _ = strip_optional(tp)
    if typing.get_origin(inner) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(inner) if a is not type(None))
    return ()


def _describe(tp: Any) -> str:
    """What a member of a union takes, for an error message."""
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(c) for c in typing.get_args(tp))
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert `value` (from YAML or a command-line string) to type `tp`."""
    inner, optional = strip_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional or tp is Any:
            return None
        raise ConfigError(f"{where}: a value is required (got null)")
    members = union_members(tp)
    if members:  # `bool | Literal["auto"]`: the first member that takes the value (Literal members first)
        for member in sorted(members, key=lambda m: typing.get_origin(m) is not typing.Literal):
            try:
                return _coerce(value, member, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {' or '.join(_describe(m) for m in members)}, got {value!r}")
    if _is_dataclass_type(inner):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {inner.__name__}, got {value!r}")
        return from_dict(inner, value, where=where)
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        choices = typing.get_args(inner)
        if value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}")
        return value
    if inner in _SCALARS:
        return _SCALARS[inner](value, where)
    if origin in (list, tuple):
        return _coerce_sequence(value, inner, where)
    if origin is dict or inner is dict:
        return _coerce_mapping(value, where)
    return value


def _coerce_bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
        return value.lower() in TRUE_WORDS
    raise ConfigError(f"{where}: expected true/false, got {value!r}")


def _coerce_int(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if not isinstance(number, (int, float)) or not math.isfinite(number) or number != int(number):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    # digits stay exact past float's 53 bits
    return int(value) if isinstance(value, str) and value.lstrip("+-").isdigit() else int(number)


def _coerce_float(value: Any, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if not math.isfinite(number) or isinstance(value, bool):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    return number


def _coerce_str(value: Any, where: str) -> str:
    if isinstance(value, (dict, list)):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return str(value)


_SCALARS = {Any: lambda value, where: value, bool: _coerce_bool, int: _coerce_int, float: _coerce_float,
            str: _coerce_str}


def _coerce_sequence(value: Any, tp: Any, where: str) -> list | tuple:
    value = _listify(value)
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    args = typing.get_args(tp)
    elem = args[0] if args else Any
    out = [_coerce(v, elem, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(out) if typing.get_origin(tp) is tuple else out


def _coerce_mapping(value: Any, where: str) -> dict:
    if isinstance(value, str):
        value = yaml.safe_load(value)
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return dict(value)


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
    kwargs = {name: _coerce(value, fields[name], f"{where}.{name}" if where else name) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where + ': ' if where else ''}{exc}") from None


def to_dict(obj: Any) -> Any:
    """Plain (YAML/JSON-ready) form of a dataclass config."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if f.metadata.get("option", True)}
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


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps
    the last one, so a section written twice would silently lose the first."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: '{key}' is given twice in one mapping "
                                  f"(first on line {seen[key]}); merge the two into one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _UniqueKeyLoader.construct_mapping)


def _yaml_problem(exc: Exception) -> str:
    """`:LINE:COLUMN: not valid YAML: problem (context)` in one line (PyYAML's own text spans
    several, with the offending line quoted and a caret)."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if problem is None:
        return f": not valid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    context = getattr(exc, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def load_config(cls: type[T], path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """YAML file (optional) + dotted overrides -> validated `cls`. Errors name the file. The top-level
    keys a class lists in `RUN_RECORD_KEYS` (what a run records beside its options in the config it
    saves) are left out, so that a run's saved config is a valid config file."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            hint = f" (a run's saved config is {path / 'config.yaml'})" if path.is_dir() else ""
            raise ConfigError(not_usable("config file", path) + hint)
        try:
            loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}{_yaml_problem(exc)}") from None
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded or {}
        record = [k for k in getattr(cls, "RUN_RECORD_KEYS", ()) if k in data]
        if record:  # a run's saved config.yaml: what the run found out is no option to set
            for key in record:
                data.pop(key)
            log.info("%s: a run's saved config; its record of what the run resolved (%s) is left out", path,
                     ", ".join(record))
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path else str(exc)) from None


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
