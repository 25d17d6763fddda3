"""compiled_once: one wrapper per function and options, never the plain function kept from a trace;
compile_in_place: compiled functions swapped in and traced, the eager ones back on a failure."""

import torch

from dflash_train.utils import compile as compile_module
from dflash_train.utils.compile import compile_in_place, compiled_once


def double(x):
    return x * 2


def test_a_trace_gets_the_plain_function_and_leaves_nothing_behind(monkeypatch):
    monkeypatch.setattr(compile_module, "_COMPILED", {})
    seen = []

    def step(x):  # a compiled step whose body asks for the compiled helper, as attend() does
        fn = compiled_once(double)
        seen.append(fn)
        return fn(x) + 1

    out = torch.compile(step, backend="eager", fullgraph=True)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 3.0))
    assert seen == [double]  # inside the trace: the enclosing graph compiles it
    assert compile_module._COMPILED == {}  # and the plain function is not kept for eager callers
    wrapper = compiled_once(double)
    assert wrapper is not double and compiled_once(double) is wrapper


def test_one_wrapper_per_function_and_options(monkeypatch):
    monkeypatch.setattr(compile_module, "_COMPILED", {})
    fixed, dynamic = compiled_once(double), compiled_once(double, dynamic=None, fullgraph=False)
    assert fixed is compiled_once(double) and dynamic is compiled_once(double, dynamic=None, fullgraph=False)
    assert fixed is not dynamic and len(compile_module._COMPILED) == 2


class Owner:
    """Functions an engine swaps for compiled ones (as a StaticDecoder's per-layer functions)."""

    def __init__(self):
        self.double, self.inc = double, lambda x: x + 1


def test_compile_in_place_swaps_and_traces_once_without_autograd():
    owner, graphs, grad = Owner(), [], []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def trace():
        grad.append(torch.is_grad_enabled())
        return owner.inc(owner.double(torch.ones(2)))

    assert compile_in_place([(owner, "double"), (owner, "inc")], trace, torch.device("cpu"), backend=backend) is None
    assert owner.double is not double and len(graphs) == 2 and grad == [False]
    with torch.no_grad():  # as the engines' steps run: the traced graphs serve, none is compiled again
        assert torch.equal(owner.inc(owner.double(torch.ones(2))), torch.full((2,), 3.0)) and len(graphs) == 2


def test_compile_in_place_puts_the_eager_functions_back_on_a_failure():
    owner = Owner()
    plain = (owner.double, owner.inc)

    def failing_backend(gm, example_inputs):
        raise RuntimeError("no kernel for this")

    exc = compile_in_place([(owner, "double"), (owner, "inc")], lambda: owner.double(torch.ones(2)), torch.device("cpu"),
                           backend=failing_backend)
    assert "no kernel for this" in str(exc) and (owner.double, owner.inc) == plain

    def trace_that_raises():
        assert owner.double is not double  # the compiled one is in place while tracing
        raise ValueError("out of memory")

    exc = compile_in_place([(owner, "double")], trace_that_raises, torch.device("cpu"), backend="eager")
    assert isinstance(exc, ValueError) and owner.double is double
