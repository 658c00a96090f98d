"""AWQ: searched scales preserve the function in full precision (float32 logits, atol 1e-4)
for every mapping of tiny random models of each family; the search stays finite on bf16
inputs with 6e4 activations; quality floors: AWQ + RTN beats plain RTN on a problem with
salient input channels, and clipping beats no clipping. All seeded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ptq.algorithms.awq import (
    AWQResult,
    apply_awq_,
    apply_clip_,
    awq_clip_search,
    awq_search,
    grid_scales,
    make_module_loss,
    weight_mean,
)
from ptq.algorithms.rtn import rtn
from ptq.arch import block_mappings, find_blocks
from ptq.errors import PtqError
from ptq.schemes import QuantArgs
from tests.test_arch import tiny

W4G32 = QuantArgs(num_bits=4, strategy="group", group_size=32)



# --- the search itself ------------------------------------------------------------------


def test_weight_mean_normalizes_per_group():
    W = torch.tensor([[1.0, -2.0, 4.0, 8.0], [-1.0, 1.0, 0.0, -2.0]])
    args = QuantArgs(num_bits=4, strategy="group", group_size=2)
    # groups: row 0 -> [1, 2]/2, [4, 8]/8; row 1 -> [1, 1]/1, [0, 2]/2
    expected = torch.tensor([(0.5 + 1.0) / 2, (1.0 + 1.0) / 2, (0.5 + 0.0) / 2, (1.0 + 1.0) / 2])
    torch.testing.assert_close(weight_mean([W[:1], W[1:]], args), expected, atol=1e-5, rtol=0)


def test_grid_scales_formula():
    x = torch.tensor([4.0, 1.0, 0.25])
    w = torch.tensor([0.5, 1.0, 0.5])
    raw = x.pow(0.5) / (w.pow(0.5) + 1e-4)
    torch.testing.assert_close(grid_scales(x, w, 0.5), raw / (raw.max() * raw.min()).sqrt())
    torch.testing.assert_close(grid_scales(x, None, 0.0), torch.ones(3))


def test_search_tries_the_grids_and_keeps_the_best():
    x_mean = torch.tensor([4.0, 1.0, 0.25, 2.0])
    W = torch.ones(2, 4)
    args = QuantArgs(num_bits=4, strategy="channel")
    tried = []

    def distance(scales):  # smallest at r = 0.3 of the activation-only grid
        return (scales - grid_scales(x_mean, None, 0.3)).abs().sum(dim=-1)

    def loss(scales):  # [candidates, in] -> sums [candidates + 1], one element each
        tried.append(scales.clone())
        return torch.cat([distance(scales), torch.ones(1)])

    result = awq_search(x_mean, [W], loss, args=args, n_grid=10, duo_scaling="both")
    assert len(tried) == 1 and tried[0].shape == (1 + 2 * 10, 4)  # identity, then the duo and activation-only grids
    assert torch.equal(tried[0][0], torch.ones(4))
    assert torch.equal(tried[0][1 + 10 + 3], grid_scales(x_mean, None, 0.3))
    assert result.ratio == pytest.approx(0.3) and result.duo_scaling is False and result.loss == 0.0
    assert result.baseline_loss == float(distance(torch.ones(4)))

    kept = awq_search(x_mean, [W], lambda s: torch.cat([(s - 1).abs().sum(dim=-1), torch.ones(1)]), args=args,
                      n_grid=10)
    assert kept.ratio is None and torch.equal(kept.scales, torch.ones(4))  # RTN was best


def test_search_is_finite_for_bf16_inputs_with_large_activations():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4, 64, 256, generator=g)  # [batch, tokens, in]
    X[..., :4] *= 6e4 / X[..., :4].abs().amax()  # four channels up to 6e4
    X[..., 4] = 0  # and a dead one
    X = X.to(torch.bfloat16)
    linear = nn.Linear(256, 128, bias=False).to(torch.bfloat16)
    x_mean = X.reshape(-1, 256).abs().mean(dim=0)  # bf16 [in]
    loss = make_module_loss(linear, [linear], [((x,), {}) for x in X], args=W4G32, scale_dtype=torch.bfloat16)
    result = awq_search(x_mean, [linear.weight], loss, args=W4G32, duo_scaling="both")
    assert result.scales.dtype == torch.float32
    assert torch.isfinite(result.scales).all() and (result.scales > 0).all()
    assert result.loss <= result.baseline_loss < float("inf")


def test_search_refuses_a_module_that_overflows():
    args = QuantArgs(num_bits=4, strategy="channel")
    with pytest.raises(PtqError, match="no finite loss"):
        awq_search(torch.ones(8), [torch.ones(2, 8)], lambda s: torch.full((len(s) + 1,), float("nan")), args=args,
                   n_grid=4)


def test_loss_restores_the_weights_even_when_the_forward_fails():
    linear = nn.Linear(32, 8)
    param, pointer, values = linear.weight, linear.weight.data_ptr(), linear.weight.detach().clone()
    loss = make_module_loss(linear, [linear], [((torch.randn(3, 32),), {})], args=W4G32)
    assert loss(torch.ones(1, 32))[0] > 0
    assert linear.weight is param and param.data_ptr() == pointer and torch.equal(param, values)
    failing = make_module_loss(linear, [linear], [((torch.randn(3, 32),), {})], [torch.zeros(3, 8)], args=W4G32)

    def boom(_module, _args):
        raise RuntimeError("boom")

    linear.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        failing(torch.full((1, 32), 2.0))
    assert linear.weight is param and param.data_ptr() == pointer and torch.equal(param, values)


# --- quality floors ----------------------------------------------------------------------


def _salient_problem(seed: int = 0):
    """prev Linear [256 <- 64] then balance Linear [128 <- 256]; 4 channels 50x louder."""
    g = torch.Generator().manual_seed(seed)
    prev, balance = nn.Linear(64, 256), nn.Linear(256, 128)
    with torch.no_grad():
        prev.weight.copy_(torch.randn(256, 64, generator=g) / 8)
        prev.bias.zero_()
        prev.weight[torch.randperm(256, generator=g)[:4]] *= 50
        balance.weight.copy_(torch.randn(128, 256, generator=g) / 16)
    Z = torch.randn(8, 64, 64, generator=g)  # [batch, tokens, 64]
    return prev, balance, Z


def _rtn_error(prev, balance, Z, reference) -> float:
    with torch.no_grad():
        Wq = rtn(balance.weight, W4G32, torch.float32).dequantize()  # [out, in]
        out = prev(Z) @ Wq.T + balance.bias
    return float((out - reference).pow(2).mean())


def test_awq_beats_rtn_on_salient_channels():
    prev, balance, Z = _salient_problem()
    with torch.no_grad():
        X = prev(Z)  # [batch, tokens, 256]
        reference = balance(X)
    rtn_error = _rtn_error(prev, balance, Z, reference)

    loss = make_module_loss(balance, [balance], [((x,), {}) for x in X], args=W4G32)
    result = awq_search(X.reshape(-1, 256).abs().mean(dim=0), [balance.weight], loss, args=W4G32)
    assert isinstance(result, AWQResult) and result.ratio is not None
    apply_awq_(prev, [balance], result.scales)
    with torch.no_grad():  # full precision unchanged
        torch.testing.assert_close(balance(prev(Z)), reference, atol=1e-4, rtol=1e-4)
    awq_error = _rtn_error(prev, balance, Z, reference)
    assert awq_error < 0.7 * rtn_error, (awq_error, rtn_error)
    assert result.loss == pytest.approx(awq_error, rel=1e-3)  # the loss is the error it promises


def test_clip_search_beats_no_clipping():
    torch.manual_seed(0)  # StudentT samples from the global generator
    g = torch.Generator().manual_seed(0)
    W = torch.distributions.StudentT(3.0).sample((96, 256)) / 16  # heavy tails: outliers per group
    X = torch.randn(1024, 256, generator=g)
    linear = nn.Linear(256, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(W)
    reference = X @ W.T

    def rtn_error() -> float:
        Wq = rtn(linear.weight.detach(), W4G32, torch.float32).dequantize()
        return float((X @ Wq.T - reference).pow(2).mean())

    before = rtn_error()
    max_val = awq_clip_search(linear.weight, X, W4G32)
    assert max_val.shape == (96, 256 // 32)
    full = W.abs().view(96, 8, 32).amax(dim=-1)
    assert (max_val <= full).all() and (max_val >= 0.5 * full).all() and (max_val < full).any()
    apply_clip_(linear, max_val)
    after = rtn_error()
    assert after < 0.95 * before, (after, before)


def test_clip_search_rejects_per_tensor_and_float_schemes():
    with pytest.raises(ValueError, match="int group or channel"):
        awq_clip_search(torch.randn(4, 8), torch.randn(16, 8), QuantArgs(num_bits=8, strategy="tensor"))


# --- whole models: searched scales keep the function ------------------------------------


def _capture(model, ids, inspect: nn.Module, first_balance: nn.Linear):
    """The inspected module's (args, kwargs) per batch and the balance Linears' inputs."""
    calls, xs = [], []
    h1 = inspect.register_forward_pre_hook(lambda _m, a, k: calls.append((a, k)), with_kwargs=True)
    h2 = first_balance.register_forward_pre_hook(lambda _m, a: xs.append(a[0]))
    try:
        for batch in ids:
            with torch.no_grad():
                model(input_ids=batch, use_cache=False)
    finally:
        h1.remove()
        h2.remove()
    return calls, torch.cat([x.reshape(-1, x.shape[-1]) for x in xs])


@pytest.mark.parametrize("family, kv_heads", [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen3", 4), ("opt", 4)])
def test_searched_scales_preserve_the_function(family, kv_heads):
    """Search and apply every mapping in turn (inputs re-captured after each): logits equal
    within atol 1e-4, and each search ends no worse than RTN on its own loss."""
    model = tiny(family, kv_heads=kv_heads)
    ids = torch.randint(0, 512, (2, 2, 16), generator=torch.Generator().manual_seed(1))  # [batches, batch, seq]
    with torch.no_grad():
        before = model(input_ids=ids[0], use_cache=False).logits
    changed = 0
    for block in find_blocks(model)[1]:
        for resolved in block_mappings(model, block)[0]:
            calls, X = _capture(model, ids, resolved.inspect, resolved.balance[0])
            loss = make_module_loss(resolved.inspect, list(resolved.balance), calls, args=W4G32)
            weights = [lin.weight for lin in resolved.balance]
            result = awq_search(X.abs().mean(dim=0), weights, loss, args=W4G32, n_grid=8)
            assert torch.isfinite(result.scales).all()
            assert result.loss <= result.baseline_loss
            changed += result.ratio is not None
            apply_awq_(resolved.smooth, list(resolved.balance), result.scales)
    assert changed > 0
    with torch.no_grad():
        after = model(input_ids=ids[0], use_cache=False).logits
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
