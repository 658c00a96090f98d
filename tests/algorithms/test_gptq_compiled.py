"""The compiled GPTQ column loop (gptq_loop.c) against the torch loop it replaces on a CPU.

Both do the same float32 steps; the torch loop's rank-1 updates may fuse a multiply-add
(MKL) where the compiled loop never does, so rounding decisions may differ near ties, and a
flipped code sends the rest of its row down another path: codes agree but for at most 0.1%,
at most 1% of the rows differ at all, each within 5% of the torch loop's loss, and the total
GPTQ losses differ by those rows alone (one row of 200 flipped on a 2-core AMD EPYC without
AMX: 47 codes, 1.8% of that row's loss, 1.0e-4 of the total). The compiled loop's own bits
do not depend on how many threads share its rows.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import ptq
from ptq.algorithms import gptq_compiled
from ptq.algorithms.compiled import linalg_kind
from ptq.algorithms.gptq import gptq
from ptq.recipe import load_recipe
from ptq.schemes import QuantArgs

from .test_gptq import _assert_consistent, _problem, _row_losses

CASES = [  # group size, symmetric, actorder, scales, observer, scale dtype, bits
    (128, True, "static", "updated", "mse", torch.bfloat16, 4),
    (64, False, "static", "updated", "mse", torch.bfloat16, 4),
    (None, True, "none", "updated", "minmax", torch.float32, 4),
    (32, False, "group", "updated", "minmax", torch.float16, 3),
    (64, True, "static", "original", "mse", torch.float16, 8),
    (None, False, "static", "updated", "mse", torch.bfloat16, 2),
]


def _solve(case, loop: str, monkeypatch, out: int = 200, threads: int = 1):
    group_size, symmetric, actorder, scales, observer, scale_dtype, bits = case
    W, _, H = _problem(out=out, inp=512, seed=3)
    args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy="group" if group_size else "channel",
                     group_size=group_size)
    monkeypatch.setenv(gptq_compiled.ENV, loop)
    assert gptq_compiled.loop_for(W.device, args, scale_dtype) == loop
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        result = gptq(W, H, args, scale_dtype=scale_dtype, actorder=actorder, scales=scales, observer=observer)
    finally:
        torch.set_num_threads(before)
    return result, W, H


def test_the_compiled_loop_was_built():
    # pip install builds it wherever a C compiler is (setup.py); without one ptq falls back
    assert gptq_compiled.unavailable() is None


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}-{'sym' if c[1] else 'asym'}-{c[2]}-{c[3]}-{c[4]}-{c[6]}b")
def test_compiled_loop_matches_the_torch_loop(case, monkeypatch):
    compiled, W, H = _solve(case, "compiled", monkeypatch)
    reference, _, _ = _solve(case, "torch", monkeypatch)
    differ = compiled.weight.q != reference.weight.q  # [out, in]
    assert differ.float().mean() <= 1e-3
    assert (compiled.weight.scale != reference.weight.scale).float().mean() <= 1e-3
    # a near-tie flip sends its row down another path for the rest of its columns: at most 1%
    # of the rows, each within 5% of the torch loop's loss there; the rest agree code for code,
    # so the two losses differ by the flipped rows' differences alone
    rows = differ.any(1) | (compiled.weight.scale != reference.weight.scale).any(1)  # [out]
    assert rows.float().mean() <= 0.01
    ours, theirs = _row_losses(compiled, W, H)[rows], _row_losses(reference, W, H)[rows]  # [flipped]
    assert torch.allclose(ours, theirs, rtol=0.05, atol=0)
    flipped = float((ours - theirs).abs().sum())
    assert abs(compiled.error - reference.error) <= flipped + 1e-5 * reference.error
    _assert_consistent(compiled, W, H, requantize=case[6] < 8 or case[1])
    _assert_consistent(reference, W, H, requantize=case[6] < 8 or case[1])


@pytest.mark.parametrize("case", CASES[:2], ids=["sym", "asym"])
def test_compiled_loop_does_not_depend_on_the_thread_count(case, monkeypatch):
    results = [_solve(case, "compiled", monkeypatch, out=400, threads=t)[0].weight for t in (1, 2, 3)]
    for other in results[1:]:
        assert torch.equal(other.q, results[0].q) and torch.equal(other.scale, results[0].scale)
        assert (other.zero is None) == (results[0].zero is None)
        assert other.zero is None or torch.equal(other.zero, results[0].zero)


@pytest.mark.skipif(linalg_kind() != "AVX-512",  # the library's own test of the CPU
                    reason="the block's updates take the AVX-512 code on an AVX-512 CPU only")
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]], ids=["mse", "minmax-channel", "minmax-asym-3b"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_avx512_updates_give_the_portable_codes_bits(case, threads, monkeypatch):
    # 200 rows: on one thread a tile of 128 rows and a rest of 72 (the last vector masked); on
    # two, slices of 96 and 104 rows (no whole tile; 8 rows masked)
    from ptq.algorithms import gptq as gptq_module

    wide = _solve(case, "compiled", monkeypatch, threads=threads)[0].weight
    monkeypatch.setattr(gptq_module, "BlockLoop", functools.partial(gptq_compiled.BlockLoop, portable=True))
    portable = _solve(case, "compiled", monkeypatch, threads=threads)[0].weight
    assert torch.equal(wide.q, portable.q) and torch.equal(wide.scale, portable.scale)
    assert (wide.zero is None and portable.zero is None) or torch.equal(wide.zero, portable.zero)


def test_fp8_and_gpu_solves_keep_the_torch_loop():
    fp8 = QuantArgs(num_bits=8, type="float", strategy="channel")
    assert gptq_compiled.loop_for(torch.device("cpu"), fp8, torch.bfloat16) == "torch"
    int4 = QuantArgs(num_bits=4, strategy="group", group_size=128)
    assert gptq_compiled.loop_for(torch.device("cuda"), int4, torch.bfloat16) == "torch"


def report_of(recipe_file: str):
    """The report of the bundled model quantized by recipes/<recipe_file> on 4 samples."""
    recipe = load_recipe(Path(__file__).parents[2] / "recipes" / recipe_file)
    recipe = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update={"samples": 4})})
    model, tokenizer = ptq.load_model("builtin")
    ptq.quantize(model, recipe, tokenizer=tokenizer, show_progress=False)
    return model.ptq_report


def test_the_report_names_the_factorisation_and_the_attention(monkeypatch):
    from ptq import cpu_attention
    from ptq.algorithms import compiled

    report = report_of("w4a16-gptq.yaml")
    expected = {"AVX-512": "compiled (AVX-512) up to 1536 rows, compiled blocks above",
                "AVX2": "compiled (AVX2) up to 768 rows, LAPACK above", None: "LAPACK"}[compiled.linalg_kind()]
    assert report.cpu["gptq_factorisation"] == expected
    compiled_attention = cpu_attention.available(report.compute_dtype)  # bf16 or float32 passes
    assert report.cpu["calibration_attention"] == ("compiled" if compiled_attention else "the model's own")
    monkeypatch.setattr(compiled, "linalg_kind", lambda: None)
    monkeypatch.setattr(cpu_attention, "available", lambda dtype=None: False)
    report = report_of("w4a16-gptq.yaml")
    assert report.cpu["gptq_factorisation"] == "LAPACK"
    assert report.cpu["calibration_attention"] == "the model's own"


def test_forcing_the_torch_loop_is_named_in_the_report(monkeypatch):
    monkeypatch.setenv(gptq_compiled.ENV, "torch")
    report = report_of("w4a16-gptq.yaml")
    assert report.cpu["gptq_loop"] == "torch"
    assert any("GPTQ's column loop ran in torch" in note and "PTQ_GPTQ_LOOP=torch" in note for note in report.notes)
