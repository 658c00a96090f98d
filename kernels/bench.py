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

Decode attention (run_attention_benchmark) times one decode step of Llama-3-8B-shaped attention
(32 query heads, 8 kv heads, head_dim 128) for batch B over a full cache of `context` tokens:
    bf16-sdpa     torch scaled_dot_product_attention, q [B, 32, 1, 128], K / V bf16, enable_gqa=True
    fp8, int8     decode_attention over a store with per-head scales
    int4-g32, int2-g32  decode_attention over a KIVI store, group size 32
Each row reports time, GB/s of cache bytes read (codes plus scales and zeros) and speedup over bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from . import fp8_gemm
from .fp8_gemm import w8a8_fp8_linear
from .int8_gemm import w8a8_int8_linear
from .kv_attention import QuantizedKV, decode_attention, is_supported as kv_is_supported
from .wna16_gemm import wna16_matmul

LLAMA3_8B_SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336))  # (N, K): qkvo-like, up/gate, down
BATCH_SIZES = (1, 16, 64, 256, 1024, 4096)
COLUMNS = (  # (row key, header, format)
    ("kernel", "kernel", "{}"), ("M", "M", "{}"), ("N", "N", "{}"), ("K", "K", "{}"),
    ("time_us", "time us", "{:.1f}"), ("gb_per_s", "GB/s", "{:.0f}"), ("tflop_per_s", "TFLOP/s", "{:.1f}"),
    ("speedup_vs_bf16", "vs bf16", "{:.2f}x"), ("roofline_fraction", "roofline", "{:.2f}"), ("bound", "bound", "{}"),
    ("graph_us", "graph us", "{:.1f}"), ("graph_speedup_vs_bf16", "graph vs bf16", "{:.2f}x"),
)
GRAPH_CALLS = 10  # calls captured in one CUDA graph: its replay's launch cost spread over them


def _cuda_device(device) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU: ptq bench needs one")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"ptq bench runs on a CUDA device, got device={str(device)!r}")
    return device


def _time_s(fn) -> float:
    """Median seconds per call of fn (compiles / autotunes first, outside the timed runs)."""
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


def _time_graph_s(fn) -> float:
    """Median seconds per call of fn replayed from a CUDA graph of GRAPH_CALLS calls: the GPU's
    time without the host's launch cost (what a server that captures graphs, as vLLM does, sees).
    NaN where fn cannot be captured. On the first H200 run the plain timings of the Triton
    kernels at M = 1 were 82-291 us against bf16's 19-43 us; this column tells the host's
    launch cost from the kernels' own time."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
    except RuntimeError:  # a kernel or op that cannot be captured
        torch.cuda.synchronize()
        return float("nan")
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e-3 / GRAPH_CALLS


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
    device = _cuda_device(device)
    copy_bw = measure_copy_bandwidth(device)
    peak = measure_bf16_peak(device)
    rows = []
    for N, K in shapes:
        cases = _cases(N, K, device)
        for M in ms:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)  # [tokens, in]
            baseline = graph_baseline = None
            for name, weight_bytes, fn in cases:
                seconds = _time_s(lambda: fn(x))
                graph_s = _time_graph_s(lambda: fn(x))
                baseline = seconds if baseline is None else baseline  # bf16 is timed first
                graph_baseline = graph_s if graph_baseline is None else graph_baseline
                nbytes = weight_bytes + M * K * 2 + M * N * 2
                flops = 2 * M * N * K
                memory_s, compute_s = nbytes / copy_bw, flops / peak
                rows.append(dict(
                    kernel=name, M=M, N=N, K=K, time_us=seconds * 1e6,
                    gb_per_s=nbytes / seconds / 1e9, tflop_per_s=flops / seconds / 1e12,
                    speedup_vs_bf16=baseline / seconds, roofline_fraction=max(memory_s, compute_s) / seconds,
                    bound="memory" if memory_s >= compute_s else "flops",
                    graph_us=graph_s * 1e6, graph_speedup_vs_bf16=graph_baseline / graph_s,
                    copy_gb_per_s=copy_bw / 1e9, peak_tflop_per_s=peak / 1e12,
                ))
        del cases
    return rows


def _format_rows(rows: list[dict], columns, block_keys) -> list[str]:
    """Fixed-width lines: a header, then the rows with a blank line wherever the block_keys change."""
    headers = [header for _, header, _ in columns]
    cells = [[fmt.format(row[key]) for key, _, fmt in columns] for row in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]

    def line(values):  # kernel name left-aligned, numbers right-aligned
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths)))

    lines = [line(headers)]
    previous = None
    for row, values in zip(rows, cells):
        block = tuple(row[key] for key in block_keys)
        if previous is not None and block != previous:
            lines.append("")
        previous = block
        lines.append(line(values))
    return lines


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table of run_benchmark's rows, with the measured roofs on top."""
    lines = []
    if rows and "copy_gb_per_s" in rows[0]:
        lines.append(f"roofs: copy {rows[0]['copy_gb_per_s']:.0f} GB/s, "
                     f"bf16 matmul {rows[0]['peak_tflop_per_s']:.0f} TFLOP/s")
    return "\n".join(lines + _format_rows(rows, COLUMNS, ("N", "K", "M")))


# ----------------------------------------------------------------------------- decode attention

ATTENTION_SHAPE = (32, 8, 128)  # Llama-3-8B: query heads, kv heads, head_dim
ATTENTION_BATCHES = (16, 64)
ATTENTION_CONTEXTS = (4096, 16384, 32768)
KV_FORMATS = (("fp8", None), ("int8", None), ("int4", 32), ("int2", 32))  # (kind, KIVI group size)
ATTENTION_COLUMNS = (
    ("kernel", "kernel", "{}"), ("batch", "B", "{}"), ("context", "context", "{}"), ("time_us", "time us", "{:.1f}"),
    ("gb_per_s", "GB/s", "{:.0f}"), ("speedup_vs_bf16", "vs bf16", "{:.2f}x"),
)


def kv_format_name(kind: str, group_size: int | None) -> str:
    return kind if group_size is None else f"{kind}-g{group_size}"


def random_kv_store(kind, batch, kv_heads, context, head_dim, group_size=None, device="cuda", seed=0) -> QuantizedKV:
    """A full store (length = capacity = context) of random codes whose values are O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (batch, kv_heads, context, head_dim)
    if kind in ("fp8", "int8"):
        def codes():
            if kind == "fp8":
                return (torch.randn(shape, generator=gen, device=device) * 64).to(torch.float8_e4m3fn)
            return torch.randint(-128, 128, shape, generator=gen, device=device, dtype=torch.int8)

        scale = torch.full((kv_heads,), 1 / 64, device=device)
        return QuantizedKV(kind=kind, k=codes(), v=codes(), k_scale=scale, v_scale=scale.clone(), length=context)
    bits = {"int4": 4, "int2": 2}[kind]
    packed = (batch, kv_heads, context, head_dim * bits // 8)

    def param(*dims, offset):  # scale 2 / (2^b - 1) and zero -1: values in [-1, 1]
        return torch.full(dims, offset, device=device, dtype=torch.float16) * (0.5 + torch.rand(
            dims, generator=gen, device=device, dtype=torch.float16))

    G, top = group_size, (1 << bits) - 1
    return QuantizedKV(
        kind=kind, group_size=G, length=context,
        k=torch.randint(0, 256, packed, generator=gen, device=device, dtype=torch.uint8),
        v=torch.randint(0, 256, packed, generator=gen, device=device, dtype=torch.uint8),
        k_scale=param(batch, kv_heads, context // G, head_dim, offset=2 / top),
        k_zero=param(batch, kv_heads, context // G, head_dim, offset=-1.0),
        v_scale=param(batch, kv_heads, context, head_dim // G, offset=2 / top),
        v_zero=param(batch, kv_heads, context, head_dim // G, offset=-1.0),
    )


def store_bytes(store: QuantizedKV) -> int:
    """Bytes of cache one decode step reads: the codes, plus the scales and zeros (KIVI)."""
    tensors = [store.k, store.v] + ([] if store.static else [store.k_scale, store.k_zero, store.v_scale, store.v_zero])
    return sum(t.numel() * t.element_size() for t in tensors)


def run_attention_benchmark(batches=ATTENTION_BATCHES, contexts=ATTENTION_CONTEXTS, formats=KV_FORMATS,
                            device="cuda") -> list[dict]:
    """Time one decode step of bf16 SDPA and of decode_attention per format; one dict per (kernel, B, context)."""
    device = _cuda_device(device)
    Hq, Hkv, D = ATTENTION_SHAPE
    rows = []
    for B in batches:
        for S in contexts:
            gen = torch.Generator(device=device).manual_seed(S)
            q = torch.randn(B, Hq, D, generator=gen, device=device).to(torch.bfloat16)  # [batch, heads, D]
            k, v = (torch.randn(B, Hkv, S, D, generator=gen, device=device).to(torch.bfloat16) for _ in "kv")
            q4 = q[:, :, None, :]  # [B, Hq, 1, D]: one new token
            baseline = _time_s(lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True))
            timed = [("bf16-sdpa", baseline, 2 * k.numel() * k.element_size())]
            del k, v
            for kind, G in formats:
                if not kv_is_supported(device, kind, G):
                    continue
                store = random_kv_store(kind, B, Hkv, S, D, G, device=device)
                timed.append((kv_format_name(kind, G), _time_s(lambda: decode_attention(q, store)), store_bytes(store)))
                del store
            rows += [dict(kernel=name, batch=B, context=S, time_us=seconds * 1e6, gb_per_s=nbytes / seconds / 1e9,
                          speedup_vs_bf16=baseline / seconds) for name, seconds, nbytes in timed]
    return rows


def format_attention_table(rows: list[dict]) -> str:
    """Fixed-width text table of run_attention_benchmark's rows, a block per (B, context)."""
    return "\n".join(_format_rows(rows, ATTENTION_COLUMNS, ("batch", "context")))


if __name__ == "__main__":
    print(format_table(run_benchmark()))
    print(format_attention_table(run_attention_benchmark()))
