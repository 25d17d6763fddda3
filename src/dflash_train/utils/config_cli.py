"""The command line of a job, built from its config class (utils/config.py).

`--section.field VALUE` for every leaf field (`--field-name` also accepted for `field_name`),
`--flag` / `--no-flag` for booleans, positional arguments and short aliases where a field's
metadata asks for them (`cli(positional=True)`, `cli(aliases=("-o",))`); `--config FILE` and
`--print-config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, TypeVar

from dflash_train.utils.config import (
    FALSE_WORDS,
    TRUE_WORDS,
    leaf_fields,
    load_config,
    strip_optional,
    to_dict,
    union_members,
)

T = TypeVar("T")
_DEST = "cfg__"


def _is_bool(tp: Any) -> bool:
    """A flag: `bool`, or a union holding bool (`bool | Literal["auto"]`: `--flag`, `--no-flag`, `--flag auto`)."""
    return strip_optional(tp)[0] is bool or bool in union_members(tp)


def _flag_words(tp: Any) -> tuple[str, ...]:
    """The values a flag's next word may be: true/false and the union's literal choices."""
    words = [*TRUE_WORDS, *FALSE_WORDS]
    for member in union_members(tp):
        if typing.get_origin(member) is typing.Literal:
            words += [str(c).lower() for c in typing.get_args(member)]
    return tuple(words)


def _is_list(tp: Any) -> bool:
    return typing.get_origin(strip_optional(tp)[0]) in (list, tuple)


def _spellings(name: str) -> list[str]:
    """`--field-name` first for top-level fields (the documented style), `--section.field_name`
    first for nested ones; the other spelling is accepted too."""
    dashed = f"--{name.replace('_', '-')}"
    if "_" not in name:
        return [dashed]
    return [f"--{name}", dashed] if "." in name else [dashed, f"--{name}"]


def _metavar(tp: Any) -> str:
    inner = strip_optional(tp)[0]
    if union_members(tp):  # `int | Literal["auto"]` -> {auto,INT}; `bool | Literal["auto"]` -> {auto,true,false}
        return "{" + ",".join("true,false" if m is bool else _metavar(m).strip("{}") for m in sorted(
            union_members(tp), key=lambda m: typing.get_origin(m) is not typing.Literal)) + "}"
    if typing.get_origin(inner) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(inner))) + "}"
    return getattr(inner, "__name__", "VALUE").upper()


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """`--config FILE` plus one option (or positional argument) per leaf field of `cls`."""
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="YAML file with any of the fields below (options override it)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    group = parser.add_argument_group("config (every field can also be set in the --config file)")
    for leaf in leaf_fields(cls):
        shown = to_dict(leaf.default) if leaf.default is not dataclasses.MISSING else None
        default = f" (default: {shown})" if shown not in (None, "", []) else ""
        help_text = (leaf.help + default).strip().replace("%", "%%") or None
        if leaf.positional:
            nargs = "+" if _is_list(leaf.type) else ("?" if leaf.default is not dataclasses.MISSING else None)
            parser.add_argument(f"{_DEST}{leaf.name}", metavar=leaf.name.upper(), nargs=nargs, help=help_text,
                                default=argparse.SUPPRESS)
            continue
        if _is_bool(leaf.type):
            help_text = (help_text or "") + " (--no-" + leaf.name.replace("_", "-") + " to turn off)"
        listed = _is_list(leaf.type)  # a list option given twice keeps both (`--set A=1 --set B=2`)
        group.add_argument(*leaf.aliases, *_spellings(leaf.name), dest=f"{_DEST}{leaf.name}",
                           default=argparse.SUPPRESS, nargs="+" if listed else None,
                           action="extend" if listed else "store", metavar=_metavar(leaf.type), help=help_text)


def normalize_argv(argv: list[str], cls: type) -> list[str]:
    """Command-line spellings argparse cannot take as they are, rewritten as `--name=value`:
    a bare boolean flag (`--flag` -> true, `--no-flag` -> false; `--flag false` also works)
    and a negative number as a value (`--optim.lr -1e-3`)."""
    bools: dict[str, tuple[str, ...]] = {}
    values = set()
    for leaf in leaf_fields(cls):
        names = _spellings(leaf.name) + list(leaf.aliases)
        if _is_bool(leaf.type):
            bools.update((n, _flag_words(leaf.type)) for n in names)
        else:
            values.update(names)
    out, i = [], 0
    while i < len(argv):
        token, nxt = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        if token == "--":
            out.extend(argv[i:])
            break
        if token in bools:
            if nxt is not None and nxt.lower() in bools[token]:
                out.append(f"{token}={nxt}")
                i += 2
                continue
            out.append(f"{token}=true")
        elif token.startswith("--no-") and f"--{token[5:]}" in bools:
            out.append(f"--{token[5:]}=false")
        elif token in values and nxt is not None and nxt.startswith("-") and _is_number(nxt):
            out.append(f"{token}={nxt}")
            i += 2
            continue
        else:
            out.append(token)
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len(_DEST):]: v for k, v in vars(args).items() if k.startswith(_DEST)}


def config_from_args(cls: type[T], args: argparse.Namespace) -> T:
    return load_config(cls, args.config, overrides_from_args(args))
