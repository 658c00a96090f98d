"""The calibration passes' compiled RMSNorm (ptq/cpu_norm.py, cpu_norm.c) against its
reference, transformers' LlamaRMSNorm.forward: the very same bits, on the AVX-512 path and
the portable one, and only for the norms and inputs where that holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from ptq import cpu_norm
from ptq.algorithms import compiled

# where ptq's library is built and torch runs its AVX2 or AVX-512 kernels, the compiled norm
# must find torch's order (cpu_norm.lanes): a wrong sum fails these tests rather than skips them
needs_kernel = pytest.mark.skipif(
    compiled.unavailable() is not None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="ptq's compiled library is not built, or torch runs other kernels than AVX2 and AVX-512 ones here")


def _norm(n: int, seed: int = 0, cls=LlamaRMSNorm) -> nn.Module:
    norm = cls(n, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.3 + 1).to(torch.bfloat16)
    return norm


def _inputs(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = shape[-1]  # features of very different sizes, as activations have
    return (torch.randn(shape, generator=g) * torch.rand(n, generator=g) * 3).to(torch.bfloat16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same bits, NaNs aside (torch's NaN bits differ between its own code paths): NaN
    where the other is NaN."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("shape", [(8, 256, 576), (3, 7, 1536), (5, 100), (2, 4160), (3, 16404), (2, 64), (4, 65)])
@pytest.mark.parametrize("portable", [False, True])
def test_the_bits_of_transformers_norm(shape, portable):
    # 100 and 65: a tail of values past the last whole vector; 4160 and 16404: long enough
    # for one and two levels of the sum's cascade
    norm, x = _norm(shape[-1]), _inputs(shape)
    with torch.no_grad():
        expected = norm(x)
    got = cpu_norm.rms_norm(x, norm.weight, norm.variance_epsilon, portable=portable)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    assert _same(got, expected) and not expected.isnan().any()


@needs_kernel
@pytest.mark.parametrize("portable", [False, True])
def test_strided_rows_and_values_that_are_not_finite(portable):
    norm = _norm(576)
    wide = _inputs((6, 600))
    wide[1, 3], wide[2, 5], wide[3, 7] = float("inf"), float("nan"), 3.0e38  # the last squares to inf
    x = wide[:, :576]  # rows 600 apart
    with torch.no_grad():
        expected = norm(x)
    got = cpu_norm.rms_norm(x, norm.weight, 1e-5, portable=portable)
    # the inf's row: 1/√inf = 0, so NaN (inf · 0) there and zeros beside it; the NaN's row all
    # NaN; the row whose square overflows all zeros
    assert _same(got, expected) and expected[2].isnan().all() and (expected[3] == 0).all()
    assert expected[1].isnan().sum() == 1 and not expected[[0, 4, 5]].isnan().any()


@needs_kernel
def test_the_probe_tells_the_two_orders_apart():
    # sums of squares in ATen's order for vectors of 16 and of 8 floats: on the probe's rows
    # they differ (so the probe can fail), and exactly one is torch's
    lib = compiled.library()[0]
    x = (torch.randn(cpu_norm.PROBE_ROWS, 576, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    sums = {}
    for width in (16, 8):
        sums[width] = torch.empty(x.shape[0])
        assert lib.ptq_sum_squares_bf16(x.data_ptr(), x.stride(0), x.shape[0], 576, width, sums[width].data_ptr()) == 0
    torchs = x.float().pow(2).sum(-1)
    assert not torch.equal(sums[16], sums[8])
    assert [torch.equal(sums[w], torchs) for w in (16, 8)].count(True) == 1
    assert cpu_norm.lanes() in (16, 8) and torch.equal(sums[cpu_norm.lanes()], torchs)
    assert lib.ptq_sum_squares_bf16(x.data_ptr(), x.stride(0), x.shape[0], 576, 4, sums[8].data_ptr()) == 1


@needs_kernel
def test_only_llama_style_norms_of_bf16_inputs_on_a_cpu():
    assert cpu_norm.compiled_forward(_norm(128)) is not None
    assert cpu_norm.compiled_forward(_norm(128, cls=Qwen2RMSNorm)) is not None  # the same code
    assert cpu_norm.compiled_forward(_norm(128, cls=GemmaRMSNorm)) is None  # 1 + weight: other code
    assert cpu_norm.compiled_forward(nn.LayerNorm(128)) is None

    norm = _norm(128)
    forward = cpu_norm.compiled_forward(norm)
    x = _inputs((4, 128))
    with torch.no_grad():
        assert torch.equal(forward(x), norm(x))
        assert forward(x.float()) is None  # a float32 pass
        assert forward(_inputs((4, 32))) is None  # fewer than MIN_FEATURES
        assert forward(_inputs((4, 256))[:, ::2]) is None  # strided features
        handle = norm.register_forward_hook(lambda *_: None)
        assert forward(x) is None  # a hook would not run
        handle.remove()
        assert forward(x) is not None
    assert forward(x) is None  # autograd on: the weight requires grad


@needs_kernel
def test_compiled_norms_inside_a_block_give_its_own_bits():
    """compiled_norms sets the compiled norm as the forward of a decoder layer's two
    Llama-style norms while inside: the layer's output keeps its bits, the norm computes
    compiled (spied), each module has its class's forward again after; a norm with hooks
    or a forward of its own is left to them."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16).eval()
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        norm.weight.data = (torch.rand(128) + 0.5).to(torch.bfloat16)
    x = _inputs((2, 16, 128))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    embeddings = LlamaRotaryEmbedding(config)(x, positions)
    with torch.no_grad():
        expected = layer(x, position_embeddings=embeddings)
        calls = []
        rms_norm = cpu_norm.rms_norm
        cpu_norm.rms_norm = lambda *a, **k: calls.append(1) or rms_norm(*a, **k)
        try:
            with cpu_norm.compiled_norms(layer) as count:
                assert count == 2 and "forward" in vars(layer.input_layernorm)
                got = layer(x, position_embeddings=embeddings)
        finally:
            cpu_norm.rms_norm = rms_norm
    assert calls == [1, 1] and _same(got, expected)
    assert "forward" not in vars(layer.input_layernorm) and "forward" not in vars(layer.post_attention_layernorm)
    layer.input_layernorm.register_forward_hook(lambda *_: None)
    layer.post_attention_layernorm.forward = lambda h: h  # offloading's own forward
    with torch.no_grad(), cpu_norm.compiled_norms(layer) as count:
        assert count == 1  # the hooked one is patched, and runs its class's forward at the call:
        calls.clear()
        cpu_norm.rms_norm = lambda *a, **k: calls.append(1) or rms_norm(*a, **k)
        try:
            layer.input_layernorm(x)
        finally:
            cpu_norm.rms_norm = rms_norm
    assert calls == [] and layer.post_attention_layernorm.forward(x) is x


@needs_kernel
def test_a_call_without_the_library_is_not_remembered(monkeypatch):
    """lanes() asked while the library is taken away (as a test of the torch fallbacks does)
    says None then, and the order again once it is back."""
    found = cpu_norm.lanes()
    with monkeypatch.context() as m:
        m.setattr(compiled, "library", lambda: (None, "no compiler here"))
        assert cpu_norm.lanes() is None
    assert cpu_norm.lanes() == found in (16, 8)
