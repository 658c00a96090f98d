"""The benchmark's table and its refusal without a GPU (the timings themselves need one)."""

import pytest
import torch

from ptq.kernels.bench import format_table, run_benchmark


def row(kernel, m, time_us, speedup):
    return {"kernel": kernel, "M": m, "N": 4096, "K": 4096, "time_us": time_us, "gb_per_s": 3000.0,
            "tflop_per_s": 1.5, "speedup_vs_bf16": speedup, "roofline_fraction": 0.8, "bound": "memory",
            "copy_gb_per_s": 4000.0, "peak_tflop_per_s": 700.0}


def test_format_table():
    text = format_table([row("bf16", 1, 30.0, 1.0), row("w4a16-g128", 1, 9.5, 3.16), row("bf16", 16, 31.0, 1.0)])
    lines = text.splitlines()
    assert lines[0] == "roofs: copy 4000 GB/s, bf16 matmul 700 TFLOP/s"
    assert lines[1].split() == ["kernel", "M", "N", "K", "time", "us", "GB/s", "TFLOP/s", "vs", "bf16",
                                "roofline", "bound"]
    assert lines[3].split()[:5] == ["w4a16-g128", "1", "4096", "4096", "9.5"] and "3.16x" in lines[3]
    assert lines[4] == ""  # a blank line between M blocks


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_refuses_without_gpu():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        run_benchmark()
