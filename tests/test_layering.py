"""The house's layering: every import points down (or sideways without a circle), none hides in a function.

    utils  <-  target / drafter / data  <-  generate / pipeline  <-  speculative  <-  train  <-  eval / bench  <-  cli
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


import dflash_train

SRC = Path(dflash_train.__file__).parent
LAYER = {"utils": 0, "target": 1, "drafter": 1, "data": 1, "generate": 2, "pipeline": 2, "speculative": 3,
         "train": 4, "eval": 5, "bench": 5, "cli": 6, "__main__": 6, "__init__": -1}


def _package(module_path: Path) -> str:
    rel = module_path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported dflash_train module, at module level?) for every import in a file, except
    `if TYPE_CHECKING:` blocks (annotations only, never executed)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.module.startswith("dflash_train"):
                out.append((child.module, top))
            elif isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names if a.name.startswith("dflash_train"))
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(tree, True)
    return out


def _edges() -> list[tuple[str, str, str, bool]]:
    edges = []
    for path in sorted(SRC.rglob("*.py")):
        src = _package(path)
        for module, top in _imports(path):
            parts = module.split(".")
            dst = parts[1] if len(parts) > 1 else "__init__"
            edges.append((src, dst, f"{path.relative_to(SRC)} imports {module}", top))
    return edges


def test_every_package_has_a_layer():
    packages = {_package(p) for p in SRC.rglob("*.py")}
    assert packages <= set(LAYER), f"give these a layer in LAYER: {sorted(packages - set(LAYER))}"


def test_no_upward_import():
    upward = [why for src, dst, why, _ in _edges() if src != dst and LAYER[dst] > LAYER[src] and dst != "__init__"]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_circle_between_packages():
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in _edges():
        if src != dst and dst != "__init__":
            graph.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    circles = sorted(f"{a} -> {b} -> ... -> {a}" for a in graph for b in graph[a] if reaches(b, a, {b}))
    assert not circles, "package import circles:\n" + "\n".join(circles)


def test_no_project_import_hidden_in_a_function():
    hidden = [why for _, _, why, top in _edges() if not top]
    assert not hidden, "import these at the top of the module:\n" + "\n".join(hidden)


def test_the_checker_finds_what_it_must(tmp_path):
    """The AST walk sees function-local and module-level imports, and skips TYPE_CHECKING."""
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nimport dflash_train.utils.errors\n"
                 "if TYPE_CHECKING:\n    from dflash_train.train import config\n"
                 "def f():\n    from dflash_train.eval import cli\n")
    assert _imports(f) == [("dflash_train.utils.errors", True), ("dflash_train.eval", False)]


def test_each_package_imports_on_its_own():
    """Importing every module of one package in a fresh interpreter works (no import-order
    circle). One interpreter per package, all started at once (each pays torch's import)."""
    packages = sorted(k for k in LAYER if k not in ("__init__", "__main__", "cli")) + ["cli"]
    procs = {}
    for package in packages:
        modules = sorted({".".join(("dflash_train", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
                          for p in SRC.rglob("*.py") if _package(p) == package})
        assert modules, package
        code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\n" % modules
        procs[package] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, text=True)
    failed = {}
    for package, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        if proc.returncode:
            failed[package] = err[-2000:]
    assert not failed, failed
