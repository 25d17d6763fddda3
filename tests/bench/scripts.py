"""The repository's bench scripts (bench/ is not a package), imported as modules for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str | None = None) -> ModuleType:
    """`relative` (a path from the repository root, e.g. "bench/profile_generate.py") as module
    `name` (default: the file's stem), registered in sys.modules (a dataclass looks its module up)."""
    name = name or Path(relative).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
