"""AWQ's compiled candidate grid (awq_grid.c) against the torch fake quantization it replaces
on a CPU: the same bits for every scheme and dtype it takes; its dot product against float64;
the Gram loss it feeds against the torch path and against the exact float64 loss; and the
report's note when ptq runs without its compiled loops."""

from __future__ import annotations

import itertools

import pytest
import torch

from ptq.algorithms import compiled
from ptq.algorithms.awq import candidate_weights, make_linear_loss
from ptq.schemes import QuantArgs

from .test_gptq_compiled import report_of

SCALE_DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if compiled.has_dtypes(torch.float16) else [])


def _weights(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """W [37, 192] with one outlier, and 4 candidate scales [4, 192] (the first s = 1)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(37, 192, generator=g) * 0.05
    W[3, 5] = 0.9
    scales = torch.rand(4, 192, generator=g) * 3 + 0.05
    scales[0] = 1
    return W.to(dtype), scales


def _torch_candidates(W, scales, args, scale_dtype, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(compiled, "awq_grid_for", lambda *a: False)
        return candidate_weights(W, scales, args, scale_dtype)


def test_the_compiled_grid_was_built():
    assert compiled.unavailable() is None


@pytest.mark.parametrize("bits, symmetric, group_size",
                         list(itertools.product((2, 3, 4, 8), (True, False), (32, None))))
def test_compiled_candidates_have_the_bits_of_torch_fake_quantization(bits, symmetric, group_size, monkeypatch):
    args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy="group" if group_size else "channel",
                     group_size=group_size)
    for weight_dtype, scale_dtype in itertools.product((torch.float32, torch.bfloat16), SCALE_DTYPES):
        W, scales = _weights(weight_dtype)
        assert compiled.awq_grid_for(W, args, scale_dtype)
        reference = _torch_candidates(W, scales, args, scale_dtype, monkeypatch)  # [4, out, in]
        got = candidate_weights(W, scales, args, scale_dtype)
        assert got.dtype == weight_dtype
        # bit for bit: equal as integers, so -0 and +0 differ too
        assert torch.equal(got.view(torch.int16 if weight_dtype == torch.bfloat16 else torch.int32),
                           reference.view(got.view(torch.int16 if weight_dtype == torch.bfloat16 else torch.int32).dtype))
        # the loss's differences, rounded to bf16 as the Gram GEMM takes them
        delta = torch.empty(W.shape, dtype=torch.bfloat16)
        compiled.awq_candidate(W.float().contiguous(), scales[2].contiguous(), args, scale_dtype, weight_dtype, delta,
                               delta=True)
        assert torch.equal(delta, (reference[2].float() - W.float()).bfloat16())


def _edge_weights() -> tuple[torch.Tensor, torch.Tensor]:
    """W [24, 96] whose rows reach what the AVX-512 path checks: zero groups, values near
    the float32 normal range's ends (quotients that leave it, of small and of large scales),
    an infinity and a NaN; and candidate scales [3, 96], one with values beyond 2^100."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(24, 96, generator=g) * 0.05
    W[1, :32] = 0  # a zero group: its scale is the dtype's smallest
    W[2] *= 1e-36  # candidates near and below the smallest normal
    W[3, 40] = 1e-38
    W[4] *= 1e30  # scaled by s, beyond 2^100
    W[5, 7] = float("inf")
    W[6, 50] = float("nan")
    W[7, :16] = -0.0
    W[8, 64:] = torch.linspace(1e-37, 4e-37, 32)  # by s = 2^60: scales far above SMALLEST, quotients below it
    scales = torch.rand(3, 96, generator=g) * 3 + 0.05
    scales[1, :8] = 1e-3
    scales[1, 64:] = 2.0**60
    scales[2, 9] = 2.0**101
    return W, scales


@pytest.mark.parametrize("group_size", [16, 32, None])
def test_the_vector_path_has_the_bits_of_the_portable_one(group_size):
    """On a CPU with AVX-512 the grid takes a vector path (divisions by a reciprocal and one
    exact correction), with AVX512-BF16 rounding to bf16 by its instruction where no lane is
    subnormal; elsewhere every call takes the portable loop. Bit for bit, NaN included, on
    random and on edge values (subnormal weights and quotients among them), for every scheme
    and dtype."""
    W_edge, s_edge = _edge_weights()
    for bits, symmetric in itertools.product((2, 4, 8), (True, False)):
        args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy="group" if group_size else "channel",
                         group_size=group_size)
        for (W, scales), weight_dtype, scale_dtype, delta in itertools.product(
                (_weights(torch.float32, seed=bits), (W_edge, s_edge)), (torch.float32, torch.bfloat16),
                SCALE_DTYPES, (False, True)):
            W = W.to(weight_dtype)
            W32 = W.float().contiguous()
            out_dtype = torch.bfloat16 if delta else weight_dtype
            for s in scales:
                got, portable, no_bf16 = (torch.empty(W.shape, dtype=out_dtype) for _ in range(3))
                compiled.awq_candidate(W32, s.contiguous(), args, scale_dtype, weight_dtype, got, delta)
                compiled.awq_candidate(W32, s.contiguous(), args, scale_dtype, weight_dtype, portable, delta,
                                       portable=True)
                compiled.awq_candidate(W32, s.contiguous(), args, scale_dtype, weight_dtype, no_bf16, delta,
                                       bf16_instructions=False)
                as_int = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
                case = (bits, symmetric, weight_dtype, scale_dtype, delta)
                assert torch.equal(got.view(as_int), portable.view(as_int)), case
                assert torch.equal(no_bf16.view(as_int), portable.view(as_int)), case


def test_the_grid_falls_back_to_torch_where_it_does_not_apply():
    W = torch.zeros(8, 64)
    assert not compiled.awq_grid_for(W, QuantArgs(num_bits=4, strategy="tensor"), torch.float32)
    assert not compiled.awq_grid_for(W, QuantArgs(num_bits=8, type="float", strategy="channel"), torch.float32)
    assert not compiled.awq_grid_for(W, QuantArgs(num_bits=4, strategy="group", group_size=48), torch.float32)
    assert not compiled.awq_grid_for(W.to("meta"), QuantArgs(num_bits=4, strategy="group", group_size=32),
                                     torch.float32)


def _gram_problem(dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    X = torch.randn(2048, 256, generator=g)
    X[:, :4] *= 20
    X = X.to(dtype).float()
    weights = [(torch.randn(rows, 256, generator=g) / 16).to(dtype) for rows in (96, 32)]
    scales = torch.rand(6, 256, generator=g) + 0.5
    return X, X.t() @ X, weights, scales


def _exact(X, weights, scales, args):
    W = torch.cat(weights)
    dW = candidate_weights(W, scales, args, torch.float32).double() - W.double()  # [c, out, in]
    return torch.einsum("ti,coi->cto", X.double(), dW).square().sum(dim=(1, 2))


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-3)])
def test_gram_loss_of_stacked_weights_equals_the_exact_loss(dtype, rtol, monkeypatch):
    """float32 weights: float32 GEMMs, within 1e-5 of float64. bf16 weights: ΔW and G are
    rounded to bf16 for the GEMM (the forward pass's precision), within 1e-3 (measured
    5e-4; on the bundled and SmolLM2-shaped models float32 GEMMs chose the same ratio in all
    102 pairs). The compiled and torch paths give the same GEMM, so agree within 1e-6, but
    where bf16 losses take AMX tiles or VDPBF16PS (compiled.QuadraticForm), which do not
    round ΔW·G to bf16 as the GEMM does: there each is within 1e-3 of the exact loss."""
    args = QuantArgs(num_bits=4, strategy="group", group_size=32)
    X, G, weights, scales = _gram_problem(dtype)
    exact = _exact(X, weights, scales, args)
    sums = make_linear_loss(weights, G, X.shape[0], args=args)(scales)  # [c + 1]
    assert sums[-1] == X.shape[0] * 128
    torch.testing.assert_close(sums[:-1].double(), exact, rtol=rtol, atol=0)
    with monkeypatch.context() as m:
        m.setattr(compiled, "awq_grid_for", lambda *a: False)
        in_torch = make_linear_loss(weights, G, X.shape[0], args=args)(scales)
    torch.testing.assert_close(in_torch[:-1].double(), exact, rtol=rtol, atol=0)
    if dtype == torch.float32 or not compiled.gram_kernel():
        torch.testing.assert_close(in_torch, sums, rtol=1e-6, atol=0)


@pytest.mark.skipif(not compiled.gram_kernel(), reason="this CPU (or its OS) has neither AMX tiles nor AVX512-BF16")
@pytest.mark.parametrize("rows, features", [(32, 32), (64, 96), (96, 576), (64, 1536)])  # 1536: 3 panels of G
def test_the_compiled_loss_is_the_exact_quadratic_form_of_its_bf16_inputs(rows, features):
    """Σ_r d_r G d_rᵀ from the blocks of G on and above the diagonal (those above doubled):
    within 1e-6 of float64 on the same bf16 D and G; a bf16 GEMM's output is off by ~1e-4.
    On an AMX CPU, its VDPBF16PS twin (a CPU with AVX512-BF16 and no AMX takes it) too."""
    g = torch.Generator().manual_seed(features)
    X = torch.randn(1000, features, generator=g)
    X[:, :2] *= 20
    gram = X.t() @ X  # [features, features]
    D = (torch.randn(rows, features, generator=g) / 64).bfloat16()
    exact = float((D.double() @ gram.bfloat16().double() * D.double()).sum())
    forms = [compiled.QuadraticForm(gram)]
    if compiled.gram_kernel() == "AMX" and compiled.avx512_bf16():
        forms.append(compiled.QuadraticForm(gram))
        forms[-1]._quadratic = compiled.library()[0].ptq_gram_quadratic_avx512
    for form in forms:
        assert abs(form.of(D) - exact) <= 1e-6 * abs(exact)
        assert form.of(torch.zeros(rows, features, dtype=torch.bfloat16)) == 0


def test_running_without_the_compiled_loops_is_named_in_the_report(monkeypatch):
    monkeypatch.setattr(compiled, "library", lambda: (None, "no compiler here"))
    report = report_of("w4a16-awq.yaml")
    assert report.cpu["awq_grid"] == "torch"
    assert any("AWQ's candidate weights were computed in torch" in note and "no compiler here" in note
               for note in report.notes)


def test_a_library_built_for_other_arguments_is_refused(monkeypatch):
    compiled.library.cache_clear()
    monkeypatch.setattr(compiled, "ABI", compiled.ABI + 1)
    try:
        lib, why = compiled.library()
        assert lib is None and "built for another version: reinstall ptq" in why
    finally:
        compiled.library.cache_clear()  # the next call loads it afresh, with the right ABI


def test_a_library_built_from_other_sources_is_refused(monkeypatch, tmp_path):
    """An editable install whose C code changed since the build (or whose rebuild failed,
    leaving the old library) must not be called: its functions may take other arguments."""
    from pathlib import Path

    from ptq._sources import source_digest

    package = Path(compiled.__file__).parents[1]
    here = source_digest(package)
    if here is None:
        pytest.skip("ptq is installed without its C sources: nothing to compare")
    compiled.library.cache_clear()
    try:
        lib, why = compiled.library()
        assert why is None and lib.ptq_compiled_source().decode() == here  # built from these sources
        compiled.library.cache_clear()
        monkeypatch.setattr(compiled, "source_digest", lambda _package: "0" * 16)
        lib, why = compiled.library()
        assert lib is None and "built from other C sources" in why and "pip install -e ." in why
    finally:
        compiled.library.cache_clear()


def test_the_source_digest_follows_every_c_file(tmp_path):
    from ptq._sources import source_digest

    assert source_digest(tmp_path) is None
    (tmp_path / "a.c").write_text("int a;\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.h").write_text("int b;\n")
    (tmp_path / "c.py").write_text("x = 1\n")
    first = source_digest(tmp_path)
    (tmp_path / "c.py").write_text("x = 2\n")  # not a C source
    assert source_digest(tmp_path) == first
    (tmp_path / "sub" / "b.h").write_text("int b2;\n")
    assert source_digest(tmp_path) != first
