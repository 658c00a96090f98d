"""The benchmark's floor (scripts/bench_floor.py) keeps the best rate it has seen of each
operation: a timing taken while the VM was slowed must not raise the floor."""

from tests.conftest import load_script


def _bench_floor(monkeypatch):
    return load_script("bench_floor", monkeypatch)


def test_remeasure_keeps_the_faster_timing_of_each_rate(monkeypatch):
    module = _bench_floor(monkeypatch)
    seconds = {"gemm": [2.0, 1.0, 4.0], "addr": [1.0, 1.05, 1.0]}  # per call, timing after timing
    timed = []

    def make(kind):
        def fresh():
            timed.append(kind)
            return lambda: None
        return fresh

    monkeypatch.setattr(module, "best_seconds", lambda fn, *a, **k: seconds[timed[-1]].pop(0))
    rates = module.Rates()
    assert rates._rate(("gemm",), 4e9, make("gemm")) == 2.0  # GFLOP/s: 4 GFLOP in 2 s
    assert rates._rate(("gemm",), 4e9, make("gemm")) == 2.0  # cached: not timed again
    assert rates._rate(("addr",), 1e9, make("addr")) == 1.0
    assert timed == ["gemm", "addr"]

    assert rates.remeasure() == [("gemm",)]  # 2 -> 4 GFLOP/s moved by more than 10%; addr by 5%
    assert rates.cache == {("gemm",): 4.0, ("addr",): 1.0}  # addr's second timing was slower
    assert rates.remeasure() == [("gemm",)]  # 1 GFLOP/s now: the 4 is kept
    assert rates.cache[("gemm",)] == 4.0
