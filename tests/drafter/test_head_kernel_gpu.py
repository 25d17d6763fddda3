"""The compiled LM-head chunk gradient on a GPU (compiled mode's path): Inductor writes it over the
logits, in their own buffer, with no second [c, V] tensor; its numbers are the one-hot form's."""

import pytest
import torch

from dflash_train.drafter.head_kernel import _softmax_minus_onehot, _softmax_minus_onehot_into_logits
from dflash_train.drafter.labels import IGNORE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_compiled_gradient_is_written_over_the_logits_without_a_second_chunk():
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 512, 50_000
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    labels[7] = IGNORE
    lse = torch.logsumexp(logits.float(), -1)
    want = _softmax_minus_onehot(logits, lse, labels)
    compiled = torch.compile(_softmax_minus_onehot_into_logits, dynamic=False, fullgraph=True)
    compiled(logits.clone(), lse, labels)  # compile outside the measured call
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = compiled(logits, lse, labels)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert got.data_ptr() == logits.data_ptr()
    assert extra < logits.numel() * logits.element_size() // 4  # no [c, V] temporary of any dtype
    # Inductor's exp may round differently from eager's in the last bf16 bit
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-4)
