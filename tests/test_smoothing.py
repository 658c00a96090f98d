"""Smoothing steps' statistics pass (ptq.smoothing): it stops where the last Linear it observes
is about to run, and that changes no bit of the result. Seeded tiny models."""

from __future__ import annotations

import copy

import pytest
import torch

import ptq
import ptq.smoothing as smoothing
from ptq.arch import block_mappings, find_blocks
from ptq.calibration.runner import batch_size_for
from ptq.recipe import parse_recipe
from tests.test_arch import tiny

SAMPLES = 4
IDS = torch.randint(0, 512, (SAMPLES, 32), generator=torch.Generator().manual_seed(0))  # the tiny vocabulary
STEPS = {
    "awq linear": {"awq": {"n_grid": 4, "loss": "linear"}},
    "awq module": {"awq": {"n_grid": 4, "loss": "module", "clip": True}},
    "smoothquant": {"smoothquant": {"alpha": 0.5}},
}


def _quantize(model, step: str) -> tuple[dict, list[int]]:
    """The state dict after the step and RTN, and how many forward passes each block finished."""
    scheme = "W8A8" if step == "smoothquant" else "W4A16"
    recipe = parse_recipe({"calibration": {"samples": SAMPLES, "seq_len": 32},
                           "steps": [STEPS[step], {"rtn": {"scheme": scheme}}]})
    blocks = find_blocks(model)[1]
    finished = [0] * len(blocks)
    handles = [block.register_forward_hook(lambda *_, i=i: finished.__setitem__(i, finished[i] + 1))
               for i, block in enumerate(blocks)]
    try:
        ptq.quantize(model, recipe, data=IDS, show_progress=False)
    finally:
        for handle in handles:
            handle.remove()
    return model.state_dict(), finished


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "opt"])
def test_the_statistics_pass_stops_after_its_last_input_and_changes_no_bit(family, step, monkeypatch):
    model = tiny(family).to(torch.bfloat16)
    stopped, stopped_passes = _quantize(copy.deepcopy(model), step)
    monkeypatch.setattr(smoothing, "_stop_at", lambda mappings, order: None)
    full, full_passes = _quantize(model, step)
    assert stopped.keys() == full.keys()
    for name, tensor in full.items():
        assert torch.equal(stopped[name], tensor), name
    # without the stop each block finished its statistics pass too: one more pass per batch
    batches = -(-SAMPLES // batch_size_for(SAMPLES, 32, "cpu"))
    assert [n + batches for n in stopped_passes] == full_passes


def test_no_stop_where_the_order_is_unknown_or_misses_an_observed_linear():
    model = tiny("llama")
    block = find_blocks(model)[1][0]
    mappings = block_mappings(model, block)[0]
    mlp, attention = block.mlp, block.self_attn
    order = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
             mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    assert smoothing._stop_at(mappings, order) is mlp.down_proj
    assert smoothing._stop_at(mappings, None) is None
    assert smoothing._stop_at(mappings, order[:-1]) is None  # down_proj observed, its place unknown
    assert smoothing._stop_at(mappings[:2], order) is mlp.gate_proj  # q/k/v and gate/up observed


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "opt"])
def test_searching_a_blocks_mappings_side_by_side_changes_no_bit(family, monkeypatch):
    """AWQ's linear-loss searches of a block all run before its scales are applied, side by
    side: each reads only its own balance weights, as it would one mapping at a time."""
    model = tiny(family).to(torch.bfloat16)
    side_by_side, _ = _quantize(copy.deepcopy(model), "awq linear")
    monkeypatch.setattr(smoothing, "_searches_independent", lambda mappings: False)
    one_by_one, _ = _quantize(model, "awq linear")
    for name, tensor in one_by_one.items():
        assert torch.equal(side_by_side[name], tensor), name


def test_searches_wait_where_a_mapping_balances_what_an_earlier_one_touched():
    model = tiny("llama")
    block = find_blocks(model)[1][0]
    mappings = block_mappings(model, block)[0]
    assert smoothing._searches_independent(mappings)  # in the architecture's order
    up_to_down = next(m for m in mappings if m.balance[0] is block.mlp.down_proj)
    gate_up = next(m for m in mappings if any(b is block.mlp.up_proj for b in m.balance))
    # up_proj smoothed by the first, balanced by the second: the second waits for it
    assert not smoothing._searches_independent([up_to_down, gate_up])
    assert smoothing._searches_independent([gate_up, up_to_down])
    assert not smoothing._searches_independent([gate_up, gate_up])  # the same balance Linears twice
