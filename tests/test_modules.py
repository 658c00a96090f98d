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


def test_kernel_bits_are_the_kernels():
    from ptq import kernels
    from ptq.modules import KERNEL_BITS

    assert KERNEL_BITS == kernels.SUPPORTED_BITS


def test_auto_takes_the_reference_where_no_kernel_fits():
    from ptq.modules import kernel_fits
    from ptq.schemes import QuantArgs, Scheme

    assert all(kernel_fits(scheme) for scheme in PRESETS.values())  # triton is installed here
    assert not kernel_fits(Scheme(weights=QuantArgs(num_bits=5, strategy="group", group_size=64)))


WITHOUT_TRITON = """
import importlib.machinery
import sys


class WithoutTriton(importlib.machinery.PathFinder):  # as on a machine without triton installed

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] == "triton":
            return None
        return super().find_spec(name, path, target)


sys.meta_path = [WithoutTriton if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
import torch, ptq
from ptq.errors import PtqError
from ptq.modules import kernel_fits
from ptq.schemes import PRESETS
assert not any(kernel_fits(s) for s in PRESETS.values())  # "auto" takes the reference on CUDA too
model = ptq.load(sys.argv[1], dtype=torch.float32)
reference = ptq.load(sys.argv[1], dtype=torch.float32, backend="torch")
ids = torch.arange(12).view(1, 12)
with torch.no_grad():
    assert torch.equal(model(ids).logits, reference(ids).logits)
try:
    ptq.load(sys.argv[1], backend="triton")
except PtqError as error:
    assert "needs the triton package" in str(error), error
else:
    raise AssertionError("backend triton loaded without triton")
assert "ptq.kernels" not in sys.modules
print("ok")
"""


def test_works_without_triton(tmp_path):
    # triton is a dependency on Linux only: elsewhere ptq imports, loads and computes with the
    # torch reference, and backend="triton" is refused in one line
    import subprocess
    import sys

    import ptq
    from tests.conftest import tiny_model

    ptq.save(ptq.quantize(tiny_model(), "W4A16_ASYM", show_progress=False), tmp_path / "q")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    # run outside the repository: from its root, transformers would take ptq's kernels/ folder
    # for the Hugging Face `kernels` package
    done = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, str(tmp_path / "q")], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_w4a8_never_reaches_a_module():
    # the scheme is refused before a QuantLinear exists (tests/test_schemes.py), so no forward
    # path (kernel or reference) ever sees int4 weights with int8 activations
    from pydantic import ValidationError

    from ptq.schemes import Scheme

    with pytest.raises(ValidationError, match="need 8-bit weights"):
        Scheme(weights={"num_bits": 4, "strategy": "group", "group_size": 128},
               input_activations={"num_bits": 8, "strategy": "token", "dynamic": True})
