"""Choosing the compute dtype for the device the work runs on.

On an accelerator, the model's own 16-bit dtype. On a CPU it depends on the CPU: with
AVX512-BF16 or AMX, bf16 matmuls run several times faster than float32 ones; without
them (AVX2 only) bf16 runs several times slower. So ptq measures once per process
(a few tens of milliseconds) instead of guessing from flags.
"""

from __future__ import annotations

import functools
import math
import time

import torch
import torch.nn.functional as F


@functools.cache
def cpu_bf16_is_fast() -> bool:
    """True when a bf16 Linear on this CPU beats the same float32 Linear by a clear margin.

    Each dtype's time is the fastest of several runs, so that a scheduling hiccup on a busy
    machine cannot flip the choice (about 0.05 s in all). Where bf16 is far slower (a
    reference kernel), its first run settles it, so the probe stays short there too.
    """
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024)  # F.linear(x, w), as a Linear runs

    def fastest(dtype: torch.dtype, give_up_after: float = math.inf) -> float:
        a, b = x.to(dtype), w.to(dtype)
        start = time.perf_counter()
        F.linear(a, b)  # warm up (kernel selection, thread pool)
        if time.perf_counter() - start > give_up_after:
            return math.inf
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            F.linear(a, b)
            runs.append(time.perf_counter() - start)
        return min(runs)

    float32 = fastest(torch.float32)
    return fastest(torch.bfloat16, give_up_after=20 * float32 + 0.01) < 0.7 * float32


@functools.cache
def bf16_products_split_exactly(device_type: str) -> bool:
    """True when two bf16 GEMMs on this device give a float32-accurate product.

    For bf16 inputs A, B the products are exact in float32 and a GEMM accumulates them in
    float32; only its bf16 output is rounded. hi = A @ B, then lo = A @ B - hi (an addmm
    with beta = -1, which adds its input before the one rounding) leaves hi + lo within
    about 2^-17 of the product. Checked once per device type on a small problem, so a
    backend that rounds the addmm input first is caught (and float32 GEMMs used there).
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(256, 64, generator=generator).to(device_type, torch.bfloat16)
    b = torch.randn(256, 96, generator=generator).to(device_type, torch.bfloat16)
    exact = a.double().t() @ b.double()  # [64, 96]
    hi, lo = split_bf16_product(a.t(), b)
    error = (hi.double() + lo.double() - exact).abs().max() / exact.abs().max()
    return bool(error < 2**-14)


def split_bf16_product(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a @ b for bf16 a [m, k], b [k, n] as two bf16 parts whose float32 sum is accurate."""
    hi = a @ b  # [m, n] bf16: the product rounded once
    lo = torch.addmm(hi, a, b, beta=-1)  # [m, n] bf16: what that rounding lost
    return hi, lo


def compute_dtype_for(device: torch.device | str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in: the model's on an accelerator; on a CPU, bf16 for a bf16
    model when the CPU has fast bf16 matmuls, else float32."""
    if torch.device(device).type != "cpu":
        return model_dtype
    if model_dtype == torch.bfloat16 and cpu_bf16_is_fast():
        return torch.bfloat16
    return torch.float32
