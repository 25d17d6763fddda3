import torch

from dflash_train.target.fp8 import FP8_MAX, FP8Linear, convert_decoder_linears, fp8_linear, fp8_matmul, quantize_rows
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


# ---- brute-force references in fp32/fp64 for the math that runs (fused) inside the compiled forward

def _e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite float8 e4m3fn value (as float64) and its bit pattern."""
    codes = torch.arange(256, dtype=torch.int32)
    values = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    finite = torch.isfinite(values)
    return values[finite], codes[finite]


def _round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value of each float, ties to the even bit pattern, by looking at all of them."""
    values, codes = _e4m3_table()
    dist = (v.double().reshape(-1, 1) - values[None]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tied = dist == best
    rank = tied.double() * (2.0 - (codes[None] % 2).double())  # among equally near values: an even code
    return values[rank.argmax(dim=1)].reshape(v.shape)


def test_quantize_rows_equals_the_brute_force_reference():
    torch.manual_seed(0)
    x = torch.randn(6, 96) * torch.tensor([1e-4, 0.02, 1.0, 3.0, 250.0, 1e5])[:, None]
    x[2, :4] = 0.0
    q, s = quantize_rows(x)
    want_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0  # fp32, as documented
    assert torch.equal(s, want_scale)
    want = _round_to_e4m3(x / want_scale)  # x / s in fp32, then the nearest e4m3 value
    assert torch.equal(q.double(), want)
    assert torch.equal(q.double().abs().amax(1), torch.full((6,), 448.0, dtype=torch.float64))


def test_quantize_rows_rounds_ties_to_even_and_keeps_subnormals():
    # a row whose maximum is 448 has scale 1: the values are rounded as they are
    row = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2 ** -9, 2 ** -11, 3 * 2 ** -10, 0.0])
    q, s = quantize_rows(row[None])
    assert float(s) == 1.0
    # 1.0625 lies between 1.0 and 1.125 (even: 1.0); 1.1875 between 1.125 and 1.25 (even: 1.25);
    # 2^-9 is the smallest subnormal, 2^-11 rounds to 0, 3*2^-10 is a tie between 2^-9 and 2^-8 (even: 2^-8)
    assert q.double()[0].tolist() == [448.0, 1.0, 1.25, -1.0, 2 ** -9, 0.0, 2 ** -8, 0.0]
    assert torch.equal(q.double()[0], _round_to_e4m3(row))


def test_fp8_matmul_equals_the_dequantised_product_in_fp64():
    torch.manual_seed(1)
    x, w, b = torch.randn(9, 64), torch.randn(24, 64) * 0.05, torch.randn(24)
    x8, sx = quantize_rows(x)
    lin = torch.nn.Linear(64, 24)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    f8 = FP8Linear(lin)
    got = fp8_matmul(x8, sx, f8.weight_fp8, f8.weight_scale, f8.bias, torch.float32)
    w_deq = _round_to_e4m3(w / f8.weight_scale.t()) * f8.weight_scale.t().double()  # per output channel
    want = (_round_to_e4m3(x / sx) * sx.double()) @ w_deq.t() + b.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp8_linear(x[None], f8.weight_fp8, f8.weight_scale, f8.bias)[0], got)
