"""QuantLinear: buffers as in the checkpoint, and the kernel path agrees with the reference."""

import pytest
import torch
from torch import nn

from ptq.algorithms.gptq import gptq
from ptq.algorithms.rtn import rtn
from ptq.modules import QuantLinear
from ptq.schemes import PRESETS


def make(scheme_name, g_idx=False, bias=True, seed=0, scale_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(256, 80, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 256, generator=g) * 0.05)
        if bias:
            linear.bias.copy_(torch.randn(80, generator=g))
    scheme = PRESETS[scheme_name]
    if g_idx:
        x = torch.randn(512, 256, generator=g) * torch.linspace(0.1, 3, 256)
        qw = gptq(linear.weight, 2 * x.t() @ x / 512, scheme.weights, scale_dtype=scale_dtype,
                  actorder="group").weight
    else:
        qw = rtn(linear.weight, scheme.weights, scale_dtype)
    return linear, QuantLinear.from_quantized(linear, qw, scheme), qw


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W3A16", "W8A16"])
def test_unpacks_what_it_packed(scheme):
    _, module, qw = make(scheme)
    back = module.quantized_weight()
    assert torch.equal(back.q, qw.q) and torch.equal(back.scale, qw.scale)
    assert (back.zero is None) == (qw.zero is None)
    if qw.zero is not None:
        assert torch.equal(back.zero, qw.zero)
    assert torch.equal(module.dequantized_weight(), qw.dequantize())


def test_reference_forward_is_dequantize_then_matmul():
    linear, module, qw = make("W4A16")
    x = torch.randn(3, 7, 256)
    expected = x @ qw.dequantize().float().t() + linear.bias
    torch.testing.assert_close(module(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme,g_idx", [("W4A16", False), ("W4A16_ASYM", False), ("W4A16", True), ("W8A16", False)])
def test_triton_backend_matches_reference(scheme, g_idx):
    # float32 scales: the kernel dequantizes in the activation dtype (float32 here), the
    # reference in the scale dtype; with float32 both are the same products
    _, module, _ = make(scheme, g_idx=g_idx, scale_dtype=torch.float32)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    reference = module(x)
    module.backend = "triton"  # on the CPU this runs in Triton's interpreter (tests/conftest.py)
    # float32 accumulation in both; the kernel sums K in tiles: only the rounding order differs
    torch.testing.assert_close(module(x), reference, atol=1e-4, rtol=1e-4)
