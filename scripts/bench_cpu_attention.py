"""The calibration passes' causal attention on this CPU: ptq's compiled kernel against torch's
sdpa kernel; the calibration passes take ptq's wherever it runs (ptq.cpu_attention.available).

    python scripts/bench_cpu_attention.py [--threads 1] [--repeats 5] [--dtype bfloat16]

Each shape is one sample (batch 1) with the heads of a model ptq's benchmarks and users
quantize: SmolLM2-135M's (9 query and 3 key-value heads of 64, 256 positions), the bundled
model's (8 and 2 of 32, 512), Llama-3-8B's (32 and 8 of 128, 2048). Both kernels get the
same q, k, v laid out as transformers makes them; torch's is called as transformers' sdpa
function calls it without a mask (is_causal, enable_gqa: no copies of key and value per
query head). Prints the median of --repeats timings of each, its causal GFLOP/s
(4·S²·D·H / 2), the compiled kernel's time over torch's, the largest difference between
the two outputs, and which one ptq's rule takes here. On --threads threads (1: the passes
run each batch on one thread). Nothing here is imported by ptq.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ptq import cpu_attention
from ptq.algorithms import compiled

SHAPES = {  # name: (query heads, key-value heads, positions, head dimension)
    "SmolLM2-135M": (9, 3, 256, 64),
    "bundled": (8, 2, 512, 32),
    "Llama-3-8B": (32, 8, 2048, 128),
}


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first calls allocate and, for torch, pick its kernel
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def inputs(heads: int, kv_heads: int, seq: int, dim: int, dtype: torch.dtype):
    """q [1, H, S, D], k and v [1, KV, S, D]: projections viewed [1, S, heads, D], transposed."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, h, dim, generator=g).to(dtype).transpose(1, 2)
               for h in (heads, kv_heads, kv_heads))
    return q, k, v


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (the passes use 1 per batch)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per kernel and shape (median shown)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1:
        print("error: --threads and --repeats must be at least 1", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    if not cpu_attention.available(dtype):
        print(f"error: ptq's compiled {args.dtype} attention does not run here (library not built, or the CPU "
              "lacks AVX512-BF16 for bfloat16 / AVX2 and FMA for float32)", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    print(f"{args.dtype}, {args.threads} thread(s); AMX: {compiled.amx()}; "
          f"ptq's rule takes: {'compiled' if cpu_attention.available(dtype) else 'torch sdpa'}")
    print(f"{'heads of':<14}{'H/KV':>7}{'S':>6}{'D':>5}{'compiled ms':>13}{'GFLOP/s':>9}"
          f"{'torch ms':>10}{'GFLOP/s':>9}{'compiled/torch':>16}{'max diff':>10}")
    for name, (heads, kv_heads, seq, dim) in SHAPES.items():
        q, k, v = inputs(heads, kv_heads, seq, dim, dtype)
        scale = dim**-0.5

        def ours():
            return cpu_attention.causal_attention(q, k, v, scale)  # [1, S, H, D]

        def theirs():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        with torch.no_grad():
            ms_ours, ms_theirs = median_ms(ours, args.repeats), median_ms(theirs, args.repeats)
            diff = float((ours().float() - theirs().transpose(1, 2).float()).abs().max())
        flops = 4 * seq * seq * dim * heads / 2
        print(f"{name:<14}{f'{heads}/{kv_heads}':>7}{seq:>6}{dim:>5}{ms_ours:>13.3f}{flops / ms_ours / 1e6:>9.0f}"
              f"{ms_theirs:>10.3f}{flops / ms_theirs / 1e6:>9.0f}{ms_ours / ms_theirs:>15.2f}x{diff:>10.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
