"""The house's size rules: every function of the package fits a screen (60 lines), every
module stays under 450 lines; a module or function that grows past them is split by job."""

from __future__ import annotations

import ast
from pathlib import Path

import dflash_train

SRC = Path(dflash_train.__file__).parent
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450


def oversized(src: Path) -> list[str]:
    """Each function over MAX_FUNCTION_LINES and each module over MAX_MODULE_LINES under `src`."""
    found = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(src)
        if text.count("\n") > MAX_MODULE_LINES:
            found.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    return found


def test_every_function_and_module_of_the_package_is_within_its_size():
    assert oversized(SRC) == []


def test_the_check_finds_a_long_function_and_a_long_module(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # + the def line: one over
    (tmp_path / "long_function.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "long_module.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (tmp_path / "fine.py").write_text("def g():\n    return 1\n")
    assert oversized(tmp_path) == [f"long_function.py:1 f: {MAX_FUNCTION_LINES + 1} lines",
                                   f"long_module.py: {MAX_MODULE_LINES + 1} lines"]
