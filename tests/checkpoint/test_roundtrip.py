"""Saving then loading is bit-exact; saving is atomic and never clobbers by accident."""

import json

import pytest
import torch

import ptq
from ptq.checkpoint import writer
from ptq.errors import PtqError
from ptq.modules import QuantLinear
from tests.conftest import tiny_model

SCHEMES = ["W4A16", "W4A16_ASYM", "W3A16", "W8A16"]


def quantized_tiny(scheme: str, family: str = "llama"):
    model = tiny_model(family)
    return ptq.quantize(model, scheme, show_progress=False)


def quant_buffers(model):
    return {
        f"{name}.{b}": t
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear)
        for b, t in m.named_buffers()
    }


@pytest.mark.parametrize("scheme", SCHEMES)
def test_save_load_bit_exact(tmp_path, scheme):
    model = quantized_tiny(scheme)
    ptq.save(model, tmp_path / "q")
    loaded = ptq.load(tmp_path / "q")
    before, after = quant_buffers(model), quant_buffers(loaded)
    assert before.keys() == after.keys() and before
    for key in before:
        assert torch.equal(before[key], after[key]), key
    ids = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_config_and_files(tmp_path):
    model = quantized_tiny("W4A16_ASYM")
    ptq.save(model, tmp_path / "q")
    files = sorted(p.name for p in (tmp_path / "q").iterdir())
    assert files == ["README.md", "config.json", "generation_config.json", "model.safetensors", "ptq.json",
                     "recipe.yaml"]
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["ignore"] == ["lm_head"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"], weights["group_size"]) == (4, False, 128)
    from safetensors import safe_open

    with safe_open(tmp_path / "q" / "model.safetensors", "pt") as f:
        q = "model.layers.0.self_attn.q_proj"
        assert f.get_tensor(f"{q}.weight_packed").shape == (128, 16)  # 128 inputs * 4 bits / 32
        assert f.get_tensor(f"{q}.weight_scale").dtype == torch.bfloat16
        assert f.get_tensor(f"{q}.weight_zero_point").shape == (16, 1)  # packed along outputs
        assert f.get_tensor(f"{q}.weight_shape").tolist() == [128, 128]
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16


def test_sharded(tmp_path):
    model = quantized_tiny("W4A16")
    ptq.save(model, tmp_path / "one")
    ptq.save(model, tmp_path / "many", max_shard_bytes=300_000)
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    a, b = ptq.load(tmp_path / "one"), ptq.load(tmp_path / "many")
    for (ka, ta), (kb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(ta, tb)


def test_refuses_existing_output(tmp_path):
    model = quantized_tiny("W8A16")
    (tmp_path / "q").mkdir()
    with pytest.raises(PtqError, match="already exists"):
        ptq.save(model, tmp_path / "q")
    ptq.save(model, tmp_path / "q", overwrite=True)
    assert (tmp_path / "q" / "config.json").exists()


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    model = quantized_tiny("W4A16")

    def fail(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "write_weights", fail)
    with pytest.raises(PtqError, match="writing the checkpoint failed: disk full"):
        ptq.save(model, tmp_path / "q")
    assert list(tmp_path.iterdir()) == []


def test_unquantized_model_is_rejected(tmp_path):
    with pytest.raises(PtqError, match="no quantized Linear"):
        ptq.save(tiny_model(), tmp_path / "q")
