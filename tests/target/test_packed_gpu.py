"""The packed target forward's FlexAttention path on a GPU, which the CPU tests run uncompiled:
compiled FlexAttention under the packed rows' causal-within-document block mask gives the taps
of the gathered-documents path, on rows whose documents cross the kernel's 128-token tiles,
with and without the compiled per-token pieces. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from dflash_train.target.runner import TargetRunner

from .test_packed import TAPS, _fresh, _packed

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# documents that cross FlexAttention's 128-token tiles, three rows
LENGTHS, ROWS = [100, 57, 200, 31, 140, 90, 300, 12], [[0, 1, 2], [3, 4, 5], [6, 7]]


def _on_gpu(model, batch, **runner_options):
    """The target runner's taps and final states of `batch` on the GPU."""
    runner = TargetRunner(model, TAPS, need_final=True, **runner_options)
    try:
        return runner.run_batch(batch, torch.device("cuda"))
    finally:
        runner.close()


@needs_gpu
@pytest.mark.parametrize("compile", [False, True])
def test_flex_document_attention_equals_the_gathered_documents_on_gpu(compile):
    model = _fresh("tiny").cuda()  # head dim 16: FlexAttention's GPU kernels need at least 16
    batch = _packed(LENGTHS, ROWS, vocab=512)
    out = {documents: _on_gpu(model, batch, forward="packed", compile=compile, document_attention=documents)
           for documents in ("gather", "flex")}
    torch.testing.assert_close(out["flex"].taps, out["gather"].taps, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out["flex"].final_hidden, out["gather"].final_hidden, atol=2e-5, rtol=1e-4)
    assert out["flex"].taps.abs().max() > 0 and (out["flex"].taps[batch.document_ids.cuda() < 0] == 0).all()


@needs_gpu
@pytest.mark.parametrize("forward", ["hf", "packed"])
def test_a_batch_already_on_the_gpu_gives_the_taps_of_one_moved_there(forward):
    """Direct callers (bench/fp8_check.py) hand the runner device tensors: the document maps are
    then built on the GPU, with the same taps as maps built on the CPU copy (`run_batch`)."""
    model = _fresh("tiny").cuda()
    batch = _packed(LENGTHS, ROWS, vocab=512)
    runner = TargetRunner(model, TAPS, need_final=True, forward=forward)
    try:
        ahead = runner.run_batch(batch, torch.device("cuda"))
        b = batch.to("cuda")
        direct = runner(b.input_ids, b.position_ids, b.document_ids)
    finally:
        runner.close()
    torch.testing.assert_close(direct.taps, ahead.taps, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(direct.final_hidden, ahead.final_hidden, atol=1e-6, rtol=1e-6)


@needs_gpu
@pytest.mark.parametrize("kind, documents", [("deepseek_v3", "gather"), ("deepseek_v3", "flex"),
                                             ("glm4_moe_lite", "flex"), ("qwen3_5", "gather"),
                                             ("qwen3_5_moe", "gather")])
def test_compiled_families_equal_the_hugging_face_forward_on_gpu(kind, documents):
    """DeepSeek-V3's and GLM-4.7-Flash's latent attention (keys wider than values, padded for the
    kernels) and GLM's router; Qwen3.5 and Qwen3.5-MoE (the model's linear-attention modules on the
    gathered documents, gated attention and shared experts), compiled, in float32: the taps and
    final states of transformers' own forward, on documents that cross FlexAttention's 128-token
    tiles."""
    model = _fresh(kind).cuda()
    batch = _packed(LENGTHS, ROWS, vocab=300)
    out = {"hf": _on_gpu(model, batch, forward="hf"),
           "packed": _on_gpu(model, batch, forward="packed", compile=True, document_attention=documents)}
    # the hybrids' chunked delta rule runs on the gathered documents, transformers' on whole rows: the
    # same sums in another order, a few of 200K values 3e-4 apart on an H100
    atol = 1e-3 if kind.startswith("qwen3_5") else 2e-4
    torch.testing.assert_close(out["packed"].taps, out["hf"].taps, atol=atol, rtol=1e-3)
    torch.testing.assert_close(out["packed"].final_hidden, out["hf"].final_hidden, atol=atol, rtol=1e-3)
