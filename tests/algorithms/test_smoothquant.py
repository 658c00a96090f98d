"""SmoothQuant: the scale formula against a hand computation, and exact function
preservation (float32 logits, atol 1e-4) when scales are folded into every mapping of
tiny random models of each family."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ptq.algorithms.smoothquant import apply_smoothing_, smoothquant_scales
from ptq.arch import block_mappings, find_blocks
from tests.test_arch import tiny

FAMILIES = [("llama", 2), ("llama", 4), ("mistral", 2), ("qwen2", 2), ("qwen3", 2), ("qwen3", 4), ("opt", 4)]



def test_scales_match_a_hand_computation():
    act = torch.tensor([4.0, 1.0, 0.25])
    w1 = torch.tensor([[1.0, -0.5, 2.0], [-4.0, 0.25, 1.0]])  # column max |w|: 4, 0.5, 2
    w2 = torch.tensor([[0.5, -1.0, 0.5]])  # column max |w|: 0.5, 1, 0.5 -> overall 4, 1, 2
    expected = torch.tensor([4.0**0.5 / 4.0**0.5, 1.0 / 1.0, 0.25**0.5 / 2.0**0.5])
    torch.testing.assert_close(smoothquant_scales(act, [w1, w2], alpha=0.5), expected, rtol=1e-6, atol=0)
    # alpha = 0.8: s = max|x|^0.8 / max|w|^0.2
    expected = torch.tensor([4.0**0.8 / 4.0**0.2, 1.0, 0.25**0.8 / 2.0**0.2])
    torch.testing.assert_close(smoothquant_scales(act, [w1, w2], alpha=0.8), expected, rtol=1e-6, atol=0)


def test_scales_are_finite_float32_for_dead_and_overflowed_channels():
    act = torch.tensor([0.0, float("inf"), 3.0], dtype=torch.bfloat16)
    w = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.bfloat16)
    scales = smoothquant_scales(act, [w], alpha=0.5)
    assert scales.dtype == torch.float32
    assert torch.isfinite(scales).all() and (scales >= 1e-5).all()
    assert scales[1] == 1.0  # inf statistic -> no smoothing of that channel
    torch.testing.assert_close(scales[0], torch.tensor(1e-5**0.5))  # 0 clamped to 1e-5
    with pytest.raises(ValueError, match="alpha"):
        smoothquant_scales(act, [w], alpha=1.5)


def test_apply_smoothing_to_a_linear_with_bias_is_exact():
    torch.manual_seed(0)
    prev, nxt = nn.Linear(8, 16), nn.Linear(16, 4)
    x = torch.randn(5, 8)
    before = nxt(prev(x))
    scales = torch.rand(16) * 4 + 0.25
    apply_smoothing_(prev, [nxt], scales)
    torch.testing.assert_close(nxt(prev(x)), before, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="reads 16 channels, scales have 8"):
        apply_smoothing_(prev, [nxt], torch.ones(8))


def test_apply_smoothing_keeps_dtypes():
    norm, lin = nn.LayerNorm(16).to(torch.bfloat16), nn.Linear(16, 8).to(torch.bfloat16)
    apply_smoothing_(norm, [lin], torch.full((16,), 2.0))
    assert norm.weight.dtype == norm.bias.dtype == lin.weight.dtype == torch.bfloat16
    assert torch.equal(norm.weight, torch.full((16,), 0.5, dtype=torch.bfloat16))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family, kv_heads", FAMILIES)
def test_random_scales_preserve_the_function(family, kv_heads):
    """Every usable mapping of every block, scales e^N(0,1): logits equal within atol 1e-4."""
    model = tiny(family, kv_heads=kv_heads)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    q_proj = find_blocks(model)[1][0].self_attn.q_proj.weight.clone()
    g = torch.Generator().manual_seed(2)
    applied = 0
    for block in find_blocks(model)[1]:
        usable, _ = block_mappings(model, block)
        for resolved in usable:
            scales = torch.randn(resolved.channels, generator=g).exp()
            apply_smoothing_(resolved.smooth, list(resolved.balance), scales)
            applied += 1
    assert applied == 2 * (4 if kv_heads == 4 and family != "opt" else 3)
    after = _logits(model, ids)
    assert not torch.equal(find_blocks(model)[1][0].self_attn.q_proj.weight, q_proj)  # weights did change
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, kv_heads", [("llama", 4), ("opt", 4)])
def test_smoothquant_scales_from_statistics_preserve_the_function(family, kv_heads):
    """Scales from max|x| observed on the balance Linears' inputs (alpha 0.5)."""
    model = tiny(family, kv_heads=kv_heads)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    for block in find_blocks(model)[1]:
        for resolved in block_mappings(model, block)[0]:
            seen = []
            handle = resolved.balance[0].register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
            _logits(model, ids)
            handle.remove()
            absmax = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen]).abs().amax(dim=0)
            scales = smoothquant_scales(absmax, [lin.weight for lin in resolved.balance], alpha=0.5)
            apply_smoothing_(resolved.smooth, list(resolved.balance), scales)
    torch.testing.assert_close(_logits(model, ids), before, atol=1e-4, rtol=1e-4)
