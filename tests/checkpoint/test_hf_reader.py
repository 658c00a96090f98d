"""The real reader: transformers + compressed-tensors load what ptq wrote, to the same bits.

Every scheme ptq writes loads through the default `AutoModelForCausalLM.from_pretrained`
and computes what ptq.load's model computes (tolerances stated with each comparison).
"""

import json

import compressed_tensors
import pytest
import torch
from compressed_tensors.quantization import QuantizationConfig
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

import ptq
from ptq.checkpoint.output import MANIFEST
from ptq.errors import PtqError
from ptq.modules import QuantLinear
from ptq.recipe import Calibration, GPTQStep, Recipe, RTNStep, parse_recipe
from ptq.schemes import PRESETS
from tests.conftest import tiny_model, with_float32_scales

IDS = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(0))
CALIBRATION = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(1))  # token ids


def hf_load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def quantized(family, scheme, actorder=None):
    """A tiny model quantized to a preset: RTN (static activation scales from 4 x 64 random
    tokens), or GPTQ with the given activation order."""
    cal = Calibration(samples=4, seq_len=64)
    step = RTNStep(scheme=PRESETS[scheme]) if actorder is None else GPTQStep(scheme=PRESETS[scheme], actorder=actorder)
    recipe = Recipe(calibration=cal, steps=[step])
    return ptq.quantize(tiny_model(family), recipe, data=CALIBRATION, show_progress=False)


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16_ASYM", "W3A16", "W8A16"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "opt"])
def test_transformers_dequantizes_ptq_weights_bit_exact(tmp_path, scheme, family):
    ptq.save(quantized(family, scheme), tmp_path / "q")
    ours = ptq.load(tmp_path / "q", dtype=torch.float32)  # transformers computes in float32 here
    decompressed = hf_load(tmp_path / "q", quantization_config=CompressedTensorsConfig(dequantize=True))
    for name, module in ours.named_modules():
        if isinstance(module, QuantLinear):
            expected = module.dequantized_weight().float()
            assert torch.equal(decompressed.get_submodule(name).weight, expected), name
    with torch.no_grad():
        # identical float32 weights and ops: equal up to summation order in the matmuls
        torch.testing.assert_close(decompressed(IDS).logits, ours(IDS).logits, atol=1e-5, rtol=1e-5)
    assert_default_loader_matches(tmp_path / "q", PRESETS[scheme])


def assert_default_loader_matches(path, scheme):
    """The default from_pretrained computes what ptq.load's model computes."""
    hf = hf_load(path)  # no quantization_config passed
    ours = ptq.load(path, dtype=torch.float32)
    if scheme.weights.symmetric:
        # compressed path: weights dequantized in float32 on the first forward, activations
        # fake-quantized as ptq's reference does: the same float32 products, summed in
        # another order
        ours = with_float32_scales(ours)
    # else (zero points) the config asks for the dequantize path: ptq's bf16 weights, bit for bit
    with torch.no_grad():
        torch.testing.assert_close(hf(IDS).logits, ours(IDS).logits, atol=1e-5, rtol=1e-5)
    return ours


# (preset, GPTQ activation order or None for RTN)
DEFAULT_LOADER_CASES = [
    ("W4A16", None), ("W4A16_ASYM", None), ("W3A16", None), ("W8A16", None),
    ("W8A8", None), ("FP8", None), ("FP8_DYNAMIC", None), ("W4A16", "group"), ("W4A16_ASYM", "static"),
]


@pytest.mark.parametrize("scheme,actorder", DEFAULT_LOADER_CASES, ids=lambda v: str(v))
def test_default_from_pretrained_matches_ptq_load(tmp_path, scheme, actorder):
    ptq.save(quantized("llama", scheme, actorder), tmp_path / "q")
    ours = assert_default_loader_matches(tmp_path / "q", PRESETS[scheme])
    g_idx = [hasattr(m, "weight_g_idx") for m in ours.modules() if isinstance(m, QuantLinear)]
    assert all(g_idx) if actorder == "group" else not any(g_idx)


def test_config_is_compressed_tensors_own(tmp_path):
    ptq.save(quantized("llama", "W4A16_ASYM"), tmp_path / "q")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["version"] == compressed_tensors.__version__
    assert qc["dequantize"] is True  # zero points: transformers' dequantize path (ptq.checkpoint.writer)
    parsed = QuantizationConfig.model_validate(qc)
    assert {k: v for k, v in qc.items() if k in parsed.model_dump()} == parsed.model_dump()  # nothing lost
    assert parsed.config_groups["group_0"].weights.zp_dtype == torch.int8
    ptq.save(quantized("llama", "W4A16"), tmp_path / "sym")
    assert "dequantize" not in json.loads((tmp_path / "sym" / "config.json").read_text())["quantization_config"]


def test_zero_points_with_group_order_are_refused(tmp_path):
    with pytest.raises(PtqError, match="steps.0.gptq: actorder 'group' with asymmetric weights") as caught:
        parse_recipe({"steps": [{"gptq": {"scheme": "W4A16_ASYM", "actorder": "group"}}]})
    assert "\n" not in str(caught.value)
    # built without a recipe (the algorithms' own API), the writer refuses it before any file
    from ptq.algorithms.gptq import gptq

    model = quantized("llama", "W4A16")
    name = "model.layers.0.self_attn.q_proj"
    linear = torch.nn.Linear(128, 128)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(0))
    qw = gptq(linear.weight.detach(), x.t() @ x, PRESETS["W4A16_ASYM"].weights, scale_dtype=torch.bfloat16,
              actorder="group").weight
    model.set_submodule(name, QuantLinear.from_quantized(linear, qw, PRESETS["W4A16_ASYM"]))
    with pytest.raises(PtqError, match=f"'{name}' has zero points and activation-order groups"):
        ptq.save(model, tmp_path / "q")
    assert not (tmp_path / "q").exists()


def test_save_writes_what_save_pretrained_writes(tmp_path):
    model = quantized("llama", "W4A16")
    model.generation_config.max_new_tokens = 7  # the source model's generation settings
    ptq.save(model, tmp_path / "q")
    folder = tmp_path / "q"
    assert json.loads((folder / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "generation_config.json" in json.loads((folder / MANIFEST).read_text())["files"]
    assert hf_load(folder).generation_config.max_new_tokens == 7
    ptq.save(model, folder, overwrite=True)  # the manifest lists it: the folder is ptq's to replace
