"""Where calibration activations wait between passes (ptq.calibration.runner.activation_device):
on the GPU when they fit, else on the CPU, with the same results."""

from __future__ import annotations

import pytest
import torch

import ptq
import ptq.calibration.runner as runner
from ptq.arch import find_blocks
from ptq.recipe import parse_recipe
from tests.conftest import tiny_model

GIB = 1 << 30


@pytest.mark.parametrize("free_gib, expected", [(64, "cuda"), (1, "cpu")])
def test_activations_go_to_the_cpu_when_the_gpu_lacks_room(monkeypatch, free_gib, expected):
    model = tiny_model("llama")  # bf16, hidden 128, intermediate 256 (tests/conftest.py)
    _, blocks = find_blocks(model)
    config = model.config
    per_token = 2 * (3 * config.hidden_size + 2 * config.intermediate_size)  # bf16 bytes counted per token
    tokens = int(2 * GIB / per_token)  # 2 GiB of activations
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_gib * GIB, 80 * GIB))
    assert runner.activation_device(model, blocks, tokens, torch.device("cuda")).type == expected


def test_cpu_compute_keeps_activations_where_they_are():
    model = tiny_model("llama")
    _, blocks = find_blocks(model)
    assert runner.activation_device(model, blocks, 10**12, torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("sequential", [True, False])
def test_activations_waiting_elsewhere_give_the_same_model(monkeypatch, sequential):
    """The moving path (OnDevice, outputs kept on the store device) run on the CPU: "cpu:0"
    is another device object than "cpu", so every move happens, and every bit must agree."""
    recipe = parse_recipe({"calibration": {"samples": 4, "seq_len": 32, "true_sequential": sequential},
                           "steps": [{"gptq": {"scheme": "W4A16", "targets": ["Linear"],
                                               "ignore": ["lm_head"]}}]})
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    here = ptq.quantize(tiny_model("llama"), recipe, data=ids, device="cpu", show_progress=False)
    monkeypatch.setattr(runner, "activation_device", lambda *args: torch.device("cpu", 0))
    moved = ptq.quantize(tiny_model("llama"), recipe, data=ids, device="cpu", show_progress=False)
    a, b = here.state_dict(), moved.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any("wait on the CPU between passes" in note for note in moved.ptq_report.notes)
