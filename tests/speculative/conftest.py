"""The speculative tests share the generate tests' one-thread setting and the eval tests' tiny targets."""

from ..eval.conftest import loaded_targets  # noqa: F401 - fixture
from ..generate.conftest import _one_thread  # noqa: F401 - autouse fixture
