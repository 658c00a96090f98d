"""The benchmark's tables, its random KV stores and its refusal without a GPU (the timings need one)."""

import pytest
import torch

from ptq.kernels.bench import (
    format_attention_table,
    format_table,
    random_kv_store,
    run_attention_benchmark,
    run_benchmark,
    store_bytes,
)
from ptq.kernels.kv_attention import dequantize_kv


def row(kernel, m, time_us, speedup):
    return {"kernel": kernel, "M": m, "N": 4096, "K": 4096, "time_us": time_us, "gb_per_s": 3000.0,
            "tflop_per_s": 1.5, "speedup_vs_bf16": speedup, "roofline_fraction": 0.8, "bound": "memory",
            "graph_us": time_us / 2, "graph_speedup_vs_bf16": speedup * 1.5,
            "copy_gb_per_s": 4000.0, "peak_tflop_per_s": 700.0}


def test_format_table():
    text = format_table([row("bf16", 1, 30.0, 1.0), row("w4a16-g128", 1, 9.5, 3.16), row("bf16", 16, 31.0, 1.0)])
    lines = text.splitlines()
    assert lines[0] == "roofs: copy 4000 GB/s, bf16 matmul 700 TFLOP/s"
    assert lines[1].split() == ["kernel", "M", "N", "K", "time", "us", "GB/s", "TFLOP/s", "vs", "bf16",
                                "roofline", "bound", "graph", "us", "graph", "vs", "bf16"]
    assert lines[3].split()[:5] == ["w4a16-g128", "1", "4096", "4096", "9.5"] and "3.16x" in lines[3]
    assert lines[3].split()[-2:] == ["4.8", "4.74x"]  # the graph replay's columns
    assert lines[4] == ""  # a blank line between M blocks


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_refuses_without_gpu():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        run_benchmark()


def attention_row(kernel, batch, context, time_us, speedup):
    return {"kernel": kernel, "batch": batch, "context": context, "time_us": time_us, "gb_per_s": 4100.0,
            "speedup_vs_bf16": speedup}


def test_format_attention_table():
    text = format_attention_table([attention_row("bf16-sdpa", 16, 4096, 120.0, 1.0),
                                   attention_row("int4-g32", 16, 4096, 40.5, 2.96),
                                   attention_row("bf16-sdpa", 16, 16384, 470.0, 1.0)])
    lines = text.splitlines()
    assert lines[0].split() == ["kernel", "B", "context", "time", "us", "GB/s", "vs", "bf16"]
    assert lines[2].split() == ["int4-g32", "16", "4096", "40.5", "4100", "2.96x"]
    assert lines[3] == ""  # a blank line between (B, context) blocks
    assert lines[4].startswith("bf16-sdpa")


@pytest.mark.parametrize("kind,group_size,nbytes", [
    ("fp8", None, 2 * 2 * 64 * 32),  # codes only: the per-head scales are negligible
    ("int8", None, 2 * 2 * 64 * 32),
    ("int4", 32, 2 * 2 * 64 * 16 + 2 * 2 * 2 * 32 * 2 + 2 * 2 * 64 * 1 * 2),  # codes, key and value scales + zeros
    ("int2", 32, 2 * 2 * 64 * 8 + 2 * 2 * 2 * 32 * 2 + 2 * 2 * 64 * 1 * 2),
])
def test_random_kv_store(kind, group_size, nbytes):
    store = random_kv_store(kind, 1, 2, 64, 32, group_size, device="cpu")  # validated on construction
    assert store_bytes(store) == nbytes
    k, v = dequantize_kv(store)
    assert k.shape == v.shape == (1, 2, 64, 32)
    assert 0.1 < k.abs().max() < 8 and 0.1 < v.abs().max() < 8  # O(1) values


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_attention_benchmark_refuses_without_gpu():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        run_attention_benchmark()
