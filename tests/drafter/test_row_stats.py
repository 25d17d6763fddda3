"""drafter/row_stats.py: the blockwise log-sum-exp / label logit / argmax against their
definitions, with blocks small enough that every rule between blocks is exercised; then the
Triton kernel against those torch blocks (on a GPU, and in Triton's interpreter on the CPU)."""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import numpy
import pytest
import torch

import dflash_train.drafter.row_stats as row_stats_module
from dflash_train.drafter.row_stats import row_stats


def definitions(logits: torch.Tensor, labels: torch.Tensor):
    lf = logits.double()
    return torch.logsumexp(lf, -1), lf.gather(1, labels[:, None]).squeeze(1), logits.float().argmax(-1)


@pytest.fixture(params=[4, 8, row_stats_module.BLOCK])
def block(request, monkeypatch):
    monkeypatch.setattr(row_stats_module, "BLOCK", request.param)
    return request.param


@pytest.mark.parametrize("vocab", [1, 7, 8, 9, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_matches_the_definitions(block, vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(6, vocab, generator=g) * 5).to(dtype)
    labels = torch.randint(0, vocab, (6,), generator=g)
    lse, label_logit, arg = row_stats(logits, labels)
    want_lse, want_label, want_arg = definitions(logits, labels)
    assert lse.dtype == label_logit.dtype == torch.float32 and arg.dtype == torch.int64
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(label_logit.double(), want_label.float().double())
    assert torch.equal(arg, want_arg)


def test_argmax_is_the_first_index_of_the_max_within_and_across_blocks(block):
    """Ties within a block and between blocks: the earliest index wins, as in torch.argmax
    (a later block takes over only with a strictly larger max)."""
    V = 3 * 8 + 5
    logits = torch.zeros(5, V)
    logits[0, [2, 3]] = 4.0  # a tie inside the first block
    logits[1, [3, 11, 20]] = 4.0  # the same max in three blocks
    logits[2, [11, 20]] = 4.0
    logits[2, 27] = 4.5  # a larger max in the last, partial block
    logits[3, :] = -1.0  # every column ties
    logits[4, [V - 1, 0]] = 2.0
    labels = torch.zeros(5, dtype=torch.long)
    _, _, arg = row_stats(logits, labels)
    assert arg.tolist() == [2, 3, 27, 0, 0] == logits.argmax(-1).tolist()


def test_rising_max_is_rescaled_without_overflow(block):
    """The max rises block after block and the logits are huge: the running sum is rescaled
    each time and stays finite."""
    V = 40
    logits = torch.stack([torch.linspace(-3e4, 3e4, V), torch.linspace(3e4, -3e4, V), torch.full((V,), 1e4)])
    labels = torch.tensor([V - 1, 0, 17])
    lse, label_logit, arg = row_stats(logits, labels)
    want_lse, _, want_arg = definitions(logits, labels)
    assert bool(torch.isfinite(lse).all())
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    assert torch.equal(arg, want_arg)
    assert (lse - label_logit).tolist()[0] == pytest.approx(0.0, abs=1e-3)


def test_a_nan_logit_makes_the_log_sum_exp_nan(block):
    logits = torch.randn(3, 21)
    logits[1, 13] = float("nan")
    lse, _, _ = row_stats(logits, torch.zeros(3, dtype=torch.long))
    assert torch.isnan(lse).tolist() == [False, True, False]


def test_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"logits \[rows, V\] and labels \[rows\]"):
        row_stats(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available() or row_stats_module.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("vocab", [1, 4095, 4096, 4097, 151936])
def test_triton_kernel_matches_the_blocks(vocab):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(37, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16)
    logits[3, [0, vocab - 1]] = 30.0  # a tie between the first and the last block
    labels = torch.randint(0, vocab, (37,), device="cuda", generator=g)
    got = row_stats(logits, labels)
    want = row_stats_module._row_stats_blocks(logits, labels)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])


INTERPRETED_CHECK = r"""
import torch
import dflash_train.drafter.row_stats as rs

torch.manual_seed(0)
for V, rows in [(1, 3), (37, 5), (300, 4)]:
    logits = (torch.randn(rows, V) * 4).to(torch.bfloat16)
    if V > 40:
        logits[0, [2, V - 1]] = 40.0   # the max twice: in the first block and the last
        logits[1, 33] = float("nan")
    labels = torch.randint(0, V, (rows,))
    want = rs._row_stats_blocks(logits, labels)
    for block, warps in [(16, 1), (64, 2)]:
        got = rs._row_stats_triton(logits, labels, block, warps)
        assert torch.equal(torch.isnan(got[0]), torch.isnan(want[0])), (V, block)
        finite = ~torch.isnan(want[0])
        torch.testing.assert_close(got[0][finite], want[0][finite], rtol=1e-5, atol=1e-5)
        assert torch.equal(got[1], want[1]), (V, block)
        assert torch.equal(got[2][finite], want[2][finite]), (V, block, got[2], want[2])
print("interpreted kernel ok")
"""


def interpreter_unusable() -> str | None:
    """Why Triton's interpreter cannot run the kernel here, or None. Before Triton 3.7 the
    interpreter holds a scalar argument as a one-element array and turns a loop bound into
    int(that array), which NumPy 2.4+ refuses ("only 0-dimensional arrays can be converted";
    seen with Triton 3.6.0, NumPy 2.5.2 on the H200 image). 3.7 squeezes the array first."""
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package (setup.sh --dev)"
    major_minor = tuple(int(part) for part in importlib.metadata.version("triton").split(".")[:2])
    try:
        int(numpy.array([0]))
    except TypeError:
        if major_minor < (3, 7):
            return f"Triton {importlib.metadata.version('triton')}'s interpreter fails under NumPy {numpy.__version__}"
    return None


INTERPRETER_UNUSABLE = interpreter_unusable()


@pytest.mark.skipif(INTERPRETER_UNUSABLE is not None, reason=str(INTERPRETER_UNUSABLE))
def test_triton_kernel_in_the_interpreter_matches_the_blocks(tmp_path):
    """The GPU kernel itself on the CPU: Triton's interpreter (TRITON_INTERPRET=1, set before
    the kernel is defined, hence a fresh interpreter) runs it on CPU tensors, with blocks small
    enough that rows span many of them; it must give the torch blocks' numbers and argmax."""
    script = tmp_path / "check.py"
    script.write_text(INTERPRETED_CHECK)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "interpreted kernel ok" in done.stdout
