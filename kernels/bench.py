"""Benchmark of ptq's Triton kernels against torch's bf16 matmul on Llama-3-8B linear shapes.

For each weight shape (N out, K in) and batch M it times y = x @ W^T with x bf16 [M, K]:
    bf16          torch.nn.functional.linear on a bf16 weight (cuBLAS): the baseline
    w4a16-g128    wna16_matmul, int4 weights, group 128, symmetric (compressed-tensors W4A16)
    w8a16-ch      wna16_matmul, int8 weights, per-channel scales (W8A16)
    w8a8-int8     w8a8_int8_linear: per-token int8 quantization of x + int8 GEMM (W8A8)
    w8a8-fp8      w8a8_fp8_linear: per-token fp8 quantization of x + fp8 GEMM (FP8_DYNAMIC),
                  only where fp8_gemm.is_supported()
Each row reports time, achieved bandwidth and FLOP rate, speedup over bf16 and the fraction of
the roofline ideal reached: ideal time = max(bytes / copy bandwidth, FLOPs / bf16 peak), with
both roofs measured on this GPU (a device-to-device copy of 1 GiB; an 8192^3 bf16 matmul).
Bytes are the essential traffic: weights (+ scales) read once, x read once (bf16), y written once
(bf16); intermediates such as the quantized x are overhead the kernel pays. int8 and fp8 tensor
cores peak at twice the bf16 rate, so at large M a W8A8 row can exceed a roofline fraction of 1.

Times are medians of triton.testing.do_bench (L2 flushed between runs). The first call of
each kernel at a new (M bucket, N, K) autotunes it, outside the timed runs.
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from . import fp8_gemm
from .fp8_gemm import w8a8_fp8_linear
from .int8_gemm import w8a8_int8_linear
from .wna16_gemm import wna16_matmul

LLAMA3_8B_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K): qkvo-like, up/gate, down
BATCH_SIZES = (1, 16, 64, 256, 1024, 4096)
COLUMNS = (  # (row key, header, format)
    ("kernel", "kernel", "{}"), ("M", "M", "{}"), ("N", "N", "{}"), ("K", "K", "{}"),
    ("time_us", "time us", "{:.1f}"), ("gb_per_s", "GB/s", "{:.0f}"), ("tflop_per_s", "TFLOP/s", "{:.1f}"),
    ("speedup_vs_bf16", "vs bf16", "{:.2f}x"), ("roofline_fraction", "roofline", "{:.2f}"), ("bound", "bound", "{}"),
)


def _time_s(fn) -> float:
    """Median seconds per call of fn (compiles / autotunes first, outside the timed runs)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def measure_copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_s(lambda: dst.copy_(src))


def measure_bf16_peak(device, n: int = 8192) -> float:
    """FLOP per second of a large square bf16 matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    return 2 * n**3 / _time_s(lambda: a @ b)


def _cases(N: int, K: int, device) -> list:
    """(name, weight bytes, fn(x)) for each kernel at weight shape [N, K]; weights are random."""
    gen = torch.Generator(device=device).manual_seed(0)

    def words(bits):  # any int32 words are a valid packed tensor
        return torch.randint(-(2**31), 2**31 - 1, (N, K * bits // 32), generator=gen, device=device,
                             dtype=torch.int32)

    w_bf16 = torch.randn(N, K, generator=gen, device=device, dtype=torch.bfloat16) * 0.02  # [out, in]
    w4, s4 = words(4), torch.full((N, K // 128), 0.01, device=device, dtype=torch.bfloat16)
    w8, s8 = words(8), torch.full((N, 1), 0.001, device=device, dtype=torch.bfloat16)
    w_i8 = torch.randint(-128, 128, (N, K), generator=gen, device=device, dtype=torch.int8)
    s_w = torch.full((N, 1), 0.001, device=device, dtype=torch.float32)
    cases = [
        ("bf16", N * K * 2, lambda x: torch.nn.functional.linear(x, w_bf16)),
        ("w4a16-g128", N * K // 2 + s4.numel() * 2,
         lambda x: wna16_matmul(x, w4, s4, bits=4, group_size=128)),
        ("w8a16-ch", N * K + N * 2, lambda x: wna16_matmul(x, w8, s8, bits=8, group_size=None)),
        ("w8a8-int8", N * K + N * 4, lambda x: w8a8_int8_linear(x, w_i8, s_w)),
    ]
    if fp8_gemm.is_supported(device):
        w_fp8 = (w_bf16 * 1000).to(torch.float8_e4m3fn)
        cases.append(("w8a8-fp8", N * K + N * 4, lambda x: w8a8_fp8_linear(x, w_fp8, s_w)))
    return cases


def run_benchmark(shapes=LLAMA3_8B_SHAPES, ms=BATCH_SIZES, device="cuda") -> list[dict]:
    """Time every kernel at every (N, K) in shapes and M in ms; one dict per (kernel, M, N, K)."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU: ptq bench needs one")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"ptq bench runs on a CUDA device, got device={str(device)!r}")
    copy_bw = measure_copy_bandwidth(device)
    peak = measure_bf16_peak(device)
    rows = []
    for N, K in shapes:
        cases = _cases(N, K, device)
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)  # [tokens, in]
            baseline = None
            for name, weight_bytes, fn in cases:
                seconds = _time_s(lambda: fn(x))
                baseline = seconds if baseline is None else baseline  # bf16 is timed first
                nbytes = weight_bytes + M * K * 2 + M * N * 2
                flops = 2 * M * N * K
                memory_s, compute_s = nbytes / copy_bw, flops / peak
                rows.append(dict(
                    kernel=name, M=M, N=N, K=K, time_us=seconds * 1e6,
                    gb_per_s=nbytes / seconds / 1e9, tflop_per_s=flops / seconds / 1e12,
                    speedup_vs_bf16=baseline / seconds, roofline_fraction=max(memory_s, compute_s) / seconds,
                    bound="memory" if memory_s >= compute_s else "flops",
                    copy_gb_per_s=copy_bw / 1e9, peak_tflop_per_s=peak / 1e12,
                ))
        del cases
    return rows


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table of run_benchmark's rows, with the measured roofs on top."""
    headers = [header for _, header, _ in COLUMNS]
    cells = [[fmt.format(row[key]) for key, _, fmt in COLUMNS] for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]

    def line(values):  # kernel name left-aligned, numbers right-aligned
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    lines = []
    if rows and "copy_gb_per_s" in rows[0]:
        lines.append(f"roofs: copy {rows[0]['copy_gb_per_s']:.0f} GB/s, "
                     f"bf16 matmul {rows[0]['peak_tflop_per_s']:.0f} TFLOP/s")
    lines.append(line(headers))
    previous = None
    for row, values in zip(rows, cells):
        if previous is not None and (row["N"], row["K"], row["M"]) != previous:
            lines.append("")  # blank line between (shape, M) blocks
        previous = (row["N"], row["K"], row["M"])
        lines.append(line(values))
    return "\n".join(lines)

if __name__ == "__main__":
    print(format_table(run_benchmark()))
