"""The calibration passes' compiled SiLU-gated product (ptq/cpu_mlp.py, cpu_mlp.c) against its
reference, transformers' LlamaMLP.forward: the very same bits, on the AVX-512 path and the
portable one, and only for the modules and tensors where that holds."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

from ptq import cpu_mlp
from ptq.algorithms import compiled

needs_library = pytest.mark.skipif(compiled.unavailable() is not None, reason="ptq's compiled library is not built")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _pair(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).bfloat16(), torch.randn(shape, generator=g).bfloat16()


@needs_library
@pytest.mark.parametrize("shape", [(8, 256, 1536), (3, 7, 100), (5,)])  # 100, 5: tails past a vector
@pytest.mark.parametrize("portable", [False, True])
def test_the_bits_of_torch_silu_times_up(shape, portable):
    gate, up = _pair(shape)
    got = cpu_mlp.silu_mul(gate, up, portable=portable)
    assert got.shape == gate.shape and got.dtype == torch.bfloat16
    assert torch.equal(_bits(got), _bits(torch.nn.functional.silu(gate) * up))


@needs_library
@pytest.mark.parametrize("portable", [False, True])
def test_every_finite_bf16_gate_value(portable):
    """All 65536 bf16 patterns whose product stays finite, against up values from tiny to
    large: products in bf16's subnormal range and rounding ties included."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate = patterns[torch.isfinite(patterns) & (patterns.float().abs() < 1e30)]
    g = torch.Generator().manual_seed(1)
    for scale in (1e-30, 1e-3, 1.0, 1e5):
        up = (torch.randn(gate.shape, generator=g) * scale).bfloat16()
        got = cpu_mlp.silu_mul(gate, up, portable=portable)
        assert torch.equal(_bits(got), _bits(torch.nn.functional.silu(gate) * up))
    assert (torch.nn.functional.silu(gate) * up).float().abs().min() < 1e-38  # subnormal products were there


@needs_library
@pytest.mark.parametrize("portable", [False, True])
def test_gate_and_up_as_column_slices_of_one_output(portable):
    """gate/up computed in one GEMM (ptq.calibration.sequential's stacked replays): each a
    column slice of a [.., 2n] output, rows at twice their width apart; the product is
    contiguous and the same bits."""
    both, _ = _pair((3, 7, 2 * 100))  # 100: a tail past a vector in every row
    gate, up = both.split(100, dim=-1)
    assert not gate.is_contiguous()
    got = cpu_mlp.silu_mul(gate, up, portable=portable)
    assert got.is_contiguous()
    assert torch.equal(_bits(got), _bits(torch.nn.functional.silu(gate) * up))


@needs_library
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_product_that_is_not_finite_goes_back_to_torch(value):
    gate, up = _pair((4, 64))
    gate[1, 3] = value
    assert cpu_mlp.silu_mul(gate, up) is None
    gate, up = _pair((4, 64))
    up[2, 5] = value
    assert cpu_mlp.silu_mul(gate, up) is None
    gate, up = _pair((4, 64))
    gate[0, 0], up[0, 0] = 3e38, 1e10  # finite inputs, an overflowing product
    assert cpu_mlp.silu_mul(gate, up) is None


@needs_library
def test_tensors_it_does_not_take():
    gate, up = _pair((4, 64))
    assert cpu_mlp.silu_mul(gate.float(), up.float()) is None
    assert cpu_mlp.silu_mul(gate.t(), up.t()) is None  # the last dimension strided
    wide = torch.cat([gate, gate], dim=1).view(2, 2, 128)
    assert cpu_mlp.silu_mul(wide[:, :, :64].transpose(0, 1), up.view(2, 2, 64)) is None  # rows not at one stride
    assert cpu_mlp.silu_mul(gate[:0], up[:0]) is None
    assert cpu_mlp.silu_mul(gate, up[:, :32].contiguous()) is None
    assert cpu_mlp.silu_mul(gate.requires_grad_(), up) is None  # autograd would record nothing


def _llama_mlp(cls=LlamaMLP, act="silu", seed=0) -> nn.Module:
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, hidden_act=act)
    torch.manual_seed(seed)
    return cls(config).to(torch.bfloat16).eval()


@needs_library
@pytest.mark.parametrize("cls", [LlamaMLP, Qwen2MLP])
def test_a_llama_style_mlp_computes_its_own_bits_with_the_same_calls(cls, monkeypatch):
    mlp = _llama_mlp(cls)
    block = nn.ModuleDict({"mlp": mlp})
    x = torch.randn(2, 24, 64).bfloat16()
    calls = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(mlp, name).register_forward_pre_hook(lambda _m, _a, name=name: calls.append(name))
    with torch.no_grad():
        expected = mlp(x)
        before, calls[:] = list(calls), []
        compiled_calls = []
        silu_mul = cpu_mlp.silu_mul
        monkeypatch.setattr(cpu_mlp, "silu_mul", lambda *a: compiled_calls.append(1) or silu_mul(*a))
        with cpu_mlp.compiled_products(block) as names:
            assert names == ["mlp"] and "forward" in vars(mlp)
            got = mlp(x)
        assert "forward" not in vars(mlp)  # the class's forward again
    assert compiled_calls == [1] and calls == before == ["gate_proj", "up_proj", "down_proj"]
    assert torch.equal(_bits(got), _bits(expected))


@needs_library
def test_mlps_it_leaves_alone():
    gelu = _llama_mlp(act="gelu")  # Llama's code, another activation
    gemma = GemmaMLP(transformers.GemmaConfig(hidden_size=64, intermediate_size=160))
    offloaded = _llama_mlp()
    offloaded.forward = lambda x: x  # a forward set on the instance (accelerate's hooks)
    hooked = _llama_mlp()
    hooked.act_fn.register_forward_hook(lambda *_: None)
    assert [cpu_mlp.applies_to(m) for m in (gelu, gemma, offloaded)] == [False, False, False]
    assert cpu_mlp.applies_to(hooked)  # its act_fn's hooks are seen at the call:
    block = nn.ModuleDict({"mlp": hooked})
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad(), cpu_mlp.compiled_products(block):
        seen = []
        hooked.act_fn.register_forward_hook(lambda *_: seen.append(1))
        hooked(x)
    assert seen == [1]  # the class's forward ran, and called act_fn
