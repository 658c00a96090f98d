"""GPTQ's Triton column loop (ptq.algorithms.gptq_triton) against the torch loop it replaces.

On this CPU the kernel runs in Triton's interpreter (tests/kernels/conftest.py), on a GPU
compiled; the torch loop runs on the CPU in both cases. Both take the same steps, except that
the updates of a block's later columns round as each contracts them (fused multiply-adds or
not), a last-bit difference that changes a code only where a value lies on a code's edge (8
of 20,480 in the worst case here). So: the same code for at least 99.9% of the weights, the
same scale (to 1e-5) for 99% of the groups, the loss within 0.01%; a wrong step or a wrong cut of a
block at a group fit changes far more (tried on the first case: without the in-block
updates 43% of the codes differ, without the cuts at group fits 88%). The problems are
test_gptq's.
"""

from __future__ import annotations

import pytest
import torch

from ptq.algorithms import gptq as gptq_module
from ptq.algorithms.gptq import gptq
from ptq.schemes import QuantArgs
from tests.algorithms.test_gptq import _problem


def _solve(monkeypatch, loop: str, W, H, args, device, **kwargs):
    monkeypatch.setattr(gptq_module, "loop_for", lambda *a: loop)
    on = device if loop == "triton" else "cpu"
    return gptq(W.to(on), H.to(on), args, **kwargs)


CASES = [  # (bits, group_size, symmetric, actorder, scales, observer, scale_dtype)
    (4, 32, True, "static", "updated", "mse", torch.bfloat16),  # fits inside blocks, out of order
    (4, 64, False, "static", "updated", "mse", torch.bfloat16),
    (4, 128, True, "none", "updated", "minmax", torch.float16),  # fits at block starts only
    (3, 32, False, "group", "updated", "mse", torch.float32),
    (8, None, True, "static", "updated", "mse", torch.bfloat16),  # per channel: one fit, at 0
    (4, 32, False, "static", "original", "minmax", torch.bfloat16),  # no fits in the loop
    (2, 16, True, "none", "updated", "mse", torch.bfloat16),
]


@pytest.mark.parametrize("bits,group_size,symmetric,actorder,scales,observer,scale_dtype", CASES)
def test_same_codes_and_loss_as_the_torch_loop(monkeypatch, device, bits, group_size, symmetric, actorder, scales,
                                               observer, scale_dtype):
    if actorder == "group" and not symmetric:
        symmetric = True  # actorder "group" needs symmetric weights (the recipe refuses the rest)
    W, _, H = _problem(out=80, inp=256, seed=bits)  # 80 rows: a partial program of 64
    strategy = "group" if group_size else "channel"
    args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group_size)
    kwargs = dict(scale_dtype=scale_dtype, block_size=64, actorder=actorder, scales=scales, observer=observer)
    ref = _solve(monkeypatch, "torch", W, H, args, device, **kwargs)
    got = _solve(monkeypatch, "triton", W, H, args, device, **kwargs)
    assert got.fallback is None and ref.fallback is None
    assert_close_solves(got, ref)


def assert_close_solves(got, ref):
    same_codes = (got.weight.q.cpu() == ref.weight.q).float().mean().item()
    assert same_codes >= 0.999, f"{100 * (1 - same_codes):.2f}% of the codes differ"
    # float32 scales carry the fits' inputs' last bits: equal to 1e-5 (bf16 scales: a step is 0.4%)
    g, r = got.weight.scale.cpu().float(), ref.weight.scale.float()
    same_scales = ((g - r).abs() <= 1e-5 * r.abs()).float().mean().item()
    assert same_scales >= 0.99, f"{100 * (1 - same_scales):.2f}% of the scales differ"
    assert (got.weight.zero is None) == (ref.weight.zero is None)
    if ref.weight.zero is not None:
        assert (got.weight.zero.cpu() == ref.weight.zero).float().mean().item() >= 0.99
    assert got.error == pytest.approx(ref.error, rel=1e-4)


def test_blocks_of_any_size_up_to_the_kernel_limit(monkeypatch, device):
    """A ragged last block (250 columns in blocks of 128) and block_size 1; larger blocks than
    the kernel keeps in registers take the torch loop."""
    W, _, H = _problem(out=64, inp=250, seed=3)
    args = QuantArgs(num_bits=4, symmetric=False, strategy="channel")
    for block_size in (1, 128, 256):
        kwargs = dict(scale_dtype=torch.bfloat16, block_size=block_size, actorder="static")
        ref = _solve(monkeypatch, "torch", W, H, args, device, **kwargs)
        got = _solve(monkeypatch, "triton", W, H, args, device, **kwargs)
        assert_close_solves(got, ref)


def test_gpu_solves_take_it_only_when_asked(monkeypatch):
    from ptq.algorithms.gptq_compiled import loop_for

    int4, fp8 = QuantArgs(num_bits=4, strategy="channel"), QuantArgs(num_bits=8, type="float", strategy="channel")
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    monkeypatch.delenv("PTQ_GPTQ_LOOP", raising=False)
    assert loop_for(cuda, int4, torch.bfloat16) == "torch"
    monkeypatch.setenv("PTQ_GPTQ_LOOP", "triton")
    assert loop_for(cuda, int4, torch.bfloat16) == "triton"
    assert loop_for(cuda, fp8, torch.bfloat16) == "torch"  # fp8 codes: the torch loop
    assert loop_for(torch.device("cpu"), int4, torch.bfloat16) != "triton"
