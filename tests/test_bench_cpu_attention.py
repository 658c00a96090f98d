"""scripts/bench_cpu_attention.py: a row per shape with both kernels' times and their outputs'
difference, and one line with exit code 2 for bad arguments."""

import sys

import pytest

from ptq import cpu_attention
from tests.conftest import load_script


def _run(monkeypatch, *argv) -> int:
    module = load_script("bench_cpu_attention")
    monkeypatch.setattr(module, "SHAPES", {"tiny": (4, 2, 64, 32)})  # seconds, not minutes
    monkeypatch.setattr(sys, "argv", ["bench_cpu_attention.py", *argv])
    return module.main()


@pytest.mark.skipif(not cpu_attention.available(), reason="no compiled bf16 attention on this CPU")
def test_one_row_per_shape_with_both_kernels(monkeypatch, capsys):
    assert _run(monkeypatch, "--repeats", "1") == 0
    head, columns, row = capsys.readouterr().out.strip().splitlines()
    rule = "compiled" if cpu_attention.available() else "torch sdpa"
    assert head.endswith(f"ptq's rule takes: {rule}")
    assert columns.split()[-3:] == ["compiled/torch", "max", "diff"]
    name, heads, seq, dim, *times, diff = row.split()
    assert (name, heads, seq, dim) == ("tiny", "4/2", "64", "32")
    assert float(times[0]) > 0 and float(times[2]) > 0 and times[4].endswith("x")
    assert float(diff) < 0.05  # the same attention, bf16 outputs


def test_bad_arguments_are_one_line_and_exit_code_2(monkeypatch, capsys):
    assert _run(monkeypatch, "--repeats", "0") == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: --threads and --repeats must be at least 1"
