import torch

from dflash_train.target.fp8 import FP8_MAX, FP8Linear, convert_decoder_linears, quantize_rows
from dflash_train.target.runner import TargetRunner, find_decoder_layers

from .test_runner import _batch, tiny_target


def test_quantize_rows_scales_each_row_to_the_fp8_range():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 10.0, 100.0, 1e4])[:, None]
    q, s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 1)
    assert torch.allclose(q.float().abs().amax(1), torch.full((5,), FP8_MAX))
    rel = (q.float() * s - x).norm(dim=1) / x.norm(dim=1)
    assert (rel < 0.05).all()  # e4m3: 3 mantissa bits


def test_fp8_linear_matches_the_dequantised_product_and_is_close_to_fp32():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=True)
    f8 = FP8Linear(lin)
    x = torch.randn(3, 7, 64)
    y = f8(x)
    x8, sx = quantize_rows(x.reshape(-1, 64))
    w = f8.weight_fp8.float() * f8.weight_scale.t()
    torch.testing.assert_close(y.reshape(-1, 32), (x8.float() * sx) @ w.t() + lin.bias, rtol=1e-5, atol=1e-5)
    ref = lin(x)
    assert float((y - ref).norm() / ref.norm()) < 0.05


def test_fp8_target_taps_stay_close():
    model = tiny_target("qwen3")
    batch = _batch()
    runner = TargetRunner(model, [1, 3])
    ref = runner(batch.input_ids, batch.position_ids, batch.document_ids).taps
    runner.close()
    n = convert_decoder_linears(model, find_decoder_layers(model))
    assert n == 6 * 7  # q, k, v, o, gate, up, down in each of 6 layers
    got = TargetRunner(model, [1, 3])(batch.input_ids, batch.position_ids, batch.document_ids).taps
    assert float((got - ref).norm() / ref.norm()) < 0.1
