"""The benchmark's floor (scripts/bench_floor.py, its rates in scripts/bench_rates.py) keeps
the best rate it has seen of each operation, a timing taken while the VM was slowed must
not raise it, and it counts the glue between the Linears at the faster tool's rate."""

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO, load_script


def _bench_rates(monkeypatch):
    return load_script("bench_rates", monkeypatch)


def test_remeasure_keeps_the_faster_timing_of_each_rate(monkeypatch):
    module = _bench_rates(monkeypatch)
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


def test_the_floor_counts_the_glue_and_the_softmax_at_the_faster_tools_rate(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    rates_module = _bench_rates(monkeypatch)
    bench_floor = load_script("bench_floor", monkeypatch)
    elementwise = {("norm", "torch"): 1.0, ("norm", "ptq"): 2.0, ("add", "torch"): 4.0, ("add", "ptq"): 0.0,
                   ("silu_mul", "torch"): 1.0, ("silu_mul", "ptq"): 0.5}  # G elements/s; 0: ptq's does not run

    class Rates(rates_module.Rates):  # every rate given, none timed
        def _rate(self, key, flops, make):
            return {"gemm": 1000.0, "bmm": 500.0}.get(key[0], 10.0)

        def compiled_cholesky(self, n):
            return 0.0

        def compiled_inverse(self, n):
            return 0.0

        def compiled_gemm(self, m, k, n):
            return 0.0

        def compiled_block(self, out, block=128):
            return 0.0

        def attention(self, tool, *shape):
            return {"torch": 200.0, "ptq": 400.0}[tool]

        def elementwise(self, kind, tool, rows, n, dtype):
            assert rows == 16  # one batch: 2 samples of 8 tokens
            return elementwise[kind, tool]

        def rotary(self, tool, *shape):
            return {"torch": 1.0, "ptq": 3.0}[tool]

    config = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16)
    floor = bench_floor.floor_of(config, 2, 8, Rates())
    before = bench_floor.floor_of(config, 2, 8, Rates(), glue=False)
    tokens_x_layers = 2 * 8 * 2
    # per token and block: 2 norms of 64 at 2, 2 adds at 4, the product of 128 at 1, (4 + 2) heads x 16 rotated at 3
    assert floor.glue == pytest.approx(tokens_x_layers * (2 * 64 / 2 + 2 * 64 / 4 + 128 / 1 + 6 * 16 / 3) / 1e9)
    attention_flops = 2 * tokens_x_layers * (8 + 1) * 64  # two products over (8 + 1) / 2 keys, 4 x 16 query features
    assert floor.attention == pytest.approx(attention_flops / 400 / 1e9)  # the faster whole attention
    assert before.glue == 0 and before.attention == pytest.approx(attention_flops / 1000 / 1e9)  # the faster product
    assert floor.linears == before.linears and floor.hessians == before.hessians
    assert floor.forward == floor.linears + floor.attention + floor.glue
    assert floor.seconds - before.seconds == pytest.approx(floor.glue + floor.attention - before.attention)
    # the solves: a Cholesky of each solved weight's [in, in] Hessian (q/k/v, o, gate/up: 64; down: 128),
    # in³/3 at 10 GFLOP/s; the floor with the inverse also counts an inverse of each factor, as many FLOPs
    choleskys = 2 * (3 * 64**3 + 128**3) / 3 / 10 / 1e9
    assert floor.factorisation == pytest.approx(choleskys)
    with_inverse = bench_floor.floor_of(config, 2, 8, Rates(), inverse=True)
    assert with_inverse.factorisation == pytest.approx(2 * choleskys)
    assert with_inverse.seconds - floor.seconds == pytest.approx(choleskys)


def test_ptqs_own_glue_rates_are_zero_where_its_code_does_not_run(monkeypatch):
    rates = _bench_rates(monkeypatch).Rates()
    assert rates.elementwise("add", "ptq", 16, 64, torch.bfloat16) == 0  # torch's add is the only one
    assert rates.elementwise("norm", "ptq", 16, 64, torch.float32) == 0  # ptq's norm and product: bf16 alone
    assert rates.elementwise("silu_mul", "ptq", 16, 64, torch.float32) == 0
    assert rates.attention("ptq", 1, 2, 1, 8, 24, torch.bfloat16) == 0  # a head of 24 is no multiple of 32
    assert rates.cache == {}  # none of them timed
