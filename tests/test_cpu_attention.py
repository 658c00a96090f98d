"""The calibration passes' compiled causal attention (ptq/cpu_attention.py, cpu_attention.c)
against its reference, torch's scaled_dot_product_attention: as accurate against float64,
the same bits however threads split the samples, transformers' sdpa function wherever it
would compute something else (counted and named), and the model's config left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ptq import cpu_attention
from ptq.algorithms import compiled
from ptq.cpu_attention import Counts, attention_forward, causal_attention, compiled_attention

needs_kernel = pytest.mark.skipif(not cpu_attention.available(),
                                  reason="ptq's compiled library is not built, or this CPU has no AVX512-BF16")
needs_f32_kernel = pytest.mark.skipif(not cpu_attention.available(torch.float32),
                                      reason="ptq's compiled library is not built, or this CPU has no AVX2 and FMA")
needs_tiles = pytest.mark.skipif(not (cpu_attention.available() and compiled.amx()),
                                 reason="this CPU has no AMX tiles (or no compiled bf16 attention)")
# the bf16 kernel's two paths: VDPBF16PS (CPUs with AVX512-BF16 and no AMX) and AMX tiles
BF16_PATHS = [pytest.param(False, id="vdpbf16ps"), pytest.param(True, id="tiles", marks=needs_tiles)]


def test_compiled_wherever_it_runs_amx_cpus_included():
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=100,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    for dtype in (torch.bfloat16, torch.float32):
        assert cpu_attention.applies(model, "cpu", dtype) == cpu_attention.available(dtype)
        assert not cpu_attention.applies(model, "meta", dtype)  # passes on an accelerator: torch's


@needs_tiles
def test_tiles_by_default_where_the_cpu_has_them():
    """The two bf16 paths sum the products in their own orders: on this input 0.03% of the
    outputs differ in their last bit (measured on a Xeon with AMX), the rest are the same."""
    q, k, v = _qkv(3, 9, 3, 256, 64, seed=0)
    default, tiles = causal_attention(q, k, v, 0.125), causal_attention(q, k, v, 0.125, tiles=True)
    vector = causal_attention(q, k, v, 0.125, tiles=False)
    assert torch.equal(default, tiles) and not torch.equal(tiles, vector)
    assert float((tiles == vector).float().mean()) > 0.999


def _qkv(batch: int, heads: int, kv_heads: int, seq: int, dim: int, seed: int = 0, amplitude: float = 1.0,
         dtype: torch.dtype = torch.bfloat16):
    """q [B, H, S, D], k and v [B, KV, S, D], bf16 (or dtype), laid out as transformers makes
    them (projections viewed [B, S, heads, D], then transposed)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(batch, seq, heads, dim, generator=g) * amplitude).to(dtype).transpose(1, 2)
    k = torch.randn(batch, seq, kv_heads, dim, generator=g).to(dtype).transpose(1, 2)
    v = torch.randn(batch, seq, kv_heads, dim, generator=g).to(dtype).transpose(1, 2)
    return q, k, v


def _sdpa(q, k, v, dtype=None) -> torch.Tensor:
    """torch's causal attention [B, S, H, D], in q's dtype or `dtype`."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if dtype is not None:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 32), (3, 9, 3, 256, 64), (1, 4, 4, 100, 96), (2, 2, 1, 130, 128),
                                   (1, 2, 2, 2, 32), (1, 2, 1, 33, 160)])
@pytest.mark.parametrize("amplitude", [1.0, 8.0])
@pytest.mark.parametrize("tiles", BF16_PATHS)
def test_as_accurate_as_torchs_kernel(shape, amplitude, tiles):
    q, k, v = _qkv(*shape, amplitude=amplitude)
    exact = _sdpa(q, k, v, torch.float64)
    mine = causal_attention(q, k, v, shape[-1] ** -0.5, tiles=tiles)
    torchs = _sdpa(q, k, v)
    assert mine.shape == torchs.shape and mine.dtype == torch.bfloat16 and mine.is_contiguous()
    mine_error, torch_error = (mine.double() - exact).abs(), (torchs.double() - exact).abs()
    # both round float32 results to bf16: within one bf16 ulp of each other's error
    assert float(mine_error.max()) <= float(torch_error.max()) * 1.01 + 1e-6
    assert float(mine_error.mean()) <= float(torch_error.mean()) * 1.02
    assert float((mine == torchs).float().mean()) > 0.9  # most outputs the very same bf16


@needs_f32_kernel
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 32), (3, 9, 3, 256, 64), (1, 4, 4, 100, 80), (2, 2, 1, 130, 128),
                                   (1, 2, 2, 2, 16), (1, 3, 1, 9, 16)])
@pytest.mark.parametrize("amplitude", [1.0, 8.0])
def test_float32_as_accurate_as_torchs_kernel(shape, amplitude):
    """float32 throughout (no bf16 weights): the error against float64 on average within 25% of
    torch's float32 kernel's, and at most within 2x of its largest (a tail of a few ulp that
    moves with torch's own kernel: measured 0.94-1.58x on an AVX512-BF16 EPYC, equal on an
    AVX2 one; on average 0.74-1.03x there, 3-9% more on the AVX2 one)."""
    q, k, v = _qkv(*shape, amplitude=amplitude, dtype=torch.float32)
    exact = _sdpa(q, k, v, torch.float64)
    mine = causal_attention(q, k, v, shape[-1] ** -0.5)
    torchs = _sdpa(q, k, v)
    assert mine.shape == torchs.shape and mine.dtype == torch.float32 and mine.is_contiguous()
    mine_error, torch_error = (mine.double() - exact).abs(), (torchs.double() - exact).abs()
    assert float(mine_error.max()) <= float(torch_error.max()) * 2 + 1e-7
    assert float(mine_error.mean()) <= float(torch_error.mean()) * 1.25
    assert float(mine_error.max()) < 1e-5 * amplitude


KERNELS = [pytest.param(torch.bfloat16, False, marks=needs_kernel, id="bf16-vdpbf16ps"),
           pytest.param(torch.bfloat16, True, marks=needs_tiles, id="bf16-tiles"),
           pytest.param(torch.float32, None, marks=needs_f32_kernel, id="float32")]


@pytest.mark.parametrize("dtype, tiles", KERNELS)
def test_the_same_bits_on_any_thread_count_and_layout(dtype, tiles):
    q, k, v = _qkv(4, 6, 2, 70, 64, seed=1, dtype=dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = causal_attention(q, k, v, 0.125, tiles=tiles)
        torch.set_num_threads(3)
        three = causal_attention(q, k, v, 0.125, tiles=tiles)
    finally:
        torch.set_num_threads(before)
    contiguous = causal_attention(q.contiguous(), k.contiguous(), v.contiguous(), 0.125, tiles=tiles)
    assert torch.equal(one, three) and torch.equal(one, contiguous)


@pytest.mark.parametrize("dtype, tiles", KERNELS)
def test_each_sample_and_head_depends_on_its_own_inputs_only(dtype, tiles):
    q, k, v = _qkv(2, 4, 2, 50, 32, seed=2, dtype=dtype)
    whole = causal_attention(q, k, v, 0.2, tiles=tiles)
    alone = causal_attention(q[1:, 2:4], k[1:, 1:2], v[1:, 1:2], 0.2, tiles=tiles)  # sample 1, kv head 1's queries
    assert torch.equal(whole[1:, :, 2:4], alone)
    for end in (20, 17, 1):  # causal: later keys change nothing (ends inside a block of query rows too)
        prefix = causal_attention(q[:, :, :end], k[:, :, :end], v[:, :, :end], 0.2, tiles=tiles)
        assert torch.equal(whole[:, :end], prefix)


class _Module(torch.nn.Module):
    is_causal = True


@needs_kernel
def test_calls_it_cannot_serve_go_to_sdpa_and_are_counted(monkeypatch):
    counts = Counts()
    monkeypatch.setattr(cpu_attention, "COUNTS", counts)
    q, k, v = _qkv(1, 2, 2, 16, 32)
    module = _Module()
    out, weights = attention_forward(module, q, k, v, None, scaling=32**-0.5)
    assert weights is None and torch.equal(out, causal_attention(q, k, v, 32**-0.5))
    mask = torch.zeros(1, 1, 16, 16, dtype=torch.bool).tril_(0)
    cases = [
        ((q, k, v, mask), {}, "an attention mask"),
        ((q.half(), k.half(), v.half(), None), {}, "torch.float16 on cpu"),
        ((q, k, v, None), {"is_causal": False}, "not causal"),
        ((q[:, :, -1:], k, v, None), {}, "queries and keys of different lengths"),
        ((q, k, v, None), {"s_aux": torch.zeros(2)}, "arguments ['s_aux']"),
        ((q, k, v, None), {"dropout": 0.1}, "dropout"),  # last: sdpa replaced below
    ]
    for args, kwargs, why in cases:
        dropout, is_causal = kwargs.pop("dropout", 0.0), kwargs.pop("is_causal", None)
        assert cpu_attention._why_not(module, *args, dropout, is_causal, kwargs).startswith(why)
        if dropout:  # sdpa would drop at random: compare the route, not the values
            monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward",
                                lambda *a, **kw: ("sdpa", None))
            assert attention_forward(module, *args, dropout=dropout, **kwargs)[0] == "sdpa"
            continue
        out, _ = attention_forward(module, *args, scaling=32**-0.5, is_causal=is_causal, **kwargs)
        q_, k_, v_ = args[:3]
        groups = q_.shape[1] // k_.shape[1]
        expected = F.scaled_dot_product_attention(q_, k_.repeat_interleave(groups, 1), v_.repeat_interleave(groups, 1),
                                                  attn_mask=args[3], scale=32**-0.5,
                                                  is_causal=args[3] is None and is_causal is not False
                                                  and q_.shape[2] > 1)
        assert torch.equal(out, expected.transpose(1, 2)), why  # sdpa's very result
    assert counts.calls == 1 and counts.fallbacks == len(cases)
    assert counts.why == "an attention mask (padding)"  # the first reason
    assert counts.note() == ("attention: 6 of 7 calls in the calibration passes ran torch's sdpa kernel, "
                             "not ptq's compiled one (an attention mask (padding))")
    # a harmless flag passes
    attention_forward(module, q, k, v, None, scaling=32**-0.5, use_cache=False, position_ids=torch.arange(16))
    assert counts.calls == 2


@pytest.mark.parametrize("dtype, tolerance", [pytest.param(torch.bfloat16, 0.05, marks=needs_kernel),
                                              pytest.param(torch.float32, 1e-5, marks=needs_f32_kernel)])
def test_a_models_forward_under_compiled_attention(dtype, tolerance):
    import transformers

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(ids).logits.float()
        with compiled_attention(model, "cpu", dtype) as counts:
            assert model.config._attn_implementation == cpu_attention.NAME
            logits = model(ids).logits.float()
        assert model.config._attn_implementation == "sdpa"
    assert counts.calls == 2 and counts.fallbacks == 0 and counts.note() is None
    assert float((logits - reference).abs().max()) < tolerance * float(reference.abs().max())
    with pytest.raises(RuntimeError), compiled_attention(model, "cpu", dtype):
        raise RuntimeError("a failing pass")
    assert model.config._attn_implementation == "sdpa"  # restored all the same


def test_nothing_changes_without_the_kernel_or_sdpa(monkeypatch):
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=100,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    assert not cpu_attention.applies(model, "cpu", torch.bfloat16)
    with compiled_attention(model, "cpu", torch.bfloat16) as counts:
        assert counts is None and model.config._attn_implementation == "eager"
    model.config._attn_implementation = "sdpa"
    assert not cpu_attention.applies(model, "cpu", torch.float16)  # no compiled float16 kernel
    assert not cpu_attention.applies(model, "cuda", torch.bfloat16)  # passes on a GPU
    with compiled_attention(model, "cuda", torch.bfloat16) as counts:
        assert counts is None and model.config._attn_implementation == "sdpa"
    monkeypatch.setattr(cpu_attention, "available", lambda dtype=torch.bfloat16: False)
    assert not cpu_attention.applies(model, "cpu", torch.bfloat16)
    assert not cpu_attention.applies(model, "cpu", torch.float32)
    with compiled_attention(model, "cpu", torch.bfloat16) as counts:
        assert counts is None and model.config._attn_implementation == "sdpa"
