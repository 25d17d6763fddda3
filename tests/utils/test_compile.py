"""compiled_once: one wrapper per function and options, never the plain function kept from a trace."""

import torch

from dflash_train.utils import compile as compile_module
from dflash_train.utils.compile import compiled_once


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
