"""Every bundled recipe runs end to end on the bundled model, and transformers reads the result."""

from pathlib import Path

import pytest
import torch

import ptq
from ptq.modules import QuantLinear
from ptq.recipe import load_recipe
from tests.conftest import with_float32_scales

pytest.importorskip("compressed_tensors")
from transformers import AutoModelForCausalLM, CompressedTensorsConfig  # noqa: E402

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def few_samples(recipe):
    """The recipe with a small calibration set, so that every recipe runs in seconds."""
    calibration = recipe.calibration.model_copy(update={"samples": 8, "seq_len": 128})
    return recipe.model_copy(update={"calibration": calibration})


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_end_to_end(tmp_path, path):
    model, tokenizer = ptq.load_model()
    ptq.quantize(model, few_samples(load_recipe(path)), tokenizer=tokenizer, show_progress=False)
    ptq.save(model, tmp_path / "q", tokenizer=tokenizer)
    ours = ptq.load(tmp_path / "q")  # in the compute dtype the quantized model has
    ids = ptq.eval_windows(tokenizer, seq_len=128, max_windows=2)
    weights = [m for m in ours.modules() if isinstance(m, QuantLinear)]
    packed = bool(weights) and all(m.scheme.format == "pack-quantized" for m in weights)
    has_g_idx = any(hasattr(m, "weight_g_idx") for m in ours.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ours(ids).logits)  # what was saved is what was quantized
        if model.ptq_report.recipe.kv_cache is not None:  # and the cache it was quantized with
            assert ours.ptq_kv.spec == model.ptq_kv.spec
            assert torch.equal(model(ids, cache=ptq.kv_cache(model), use_cache=True).logits,
                               ours(ids, cache=ptq.kv_cache(ours), use_cache=True).logits)
        ours = ptq.load(tmp_path / "q", dtype=torch.float32)  # transformers computes in float32 here
        expected = ours(ids).logits
        if packed and not has_g_idx:
            # the dequantize=True loader reproduces ptq's bf16 weights bit for bit (it drops
            # weight_g_idx, so actorder-group checkpoints are read by the default loader only)
            hf = AutoModelForCausalLM.from_pretrained(
                tmp_path / "q", dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
            )
            torch.testing.assert_close(hf(ids).logits, expected, atol=1e-5, rtol=1e-5)
        if "asym" not in path.stem:  # see tests/checkpoint/test_hf_reader.py for the asymmetric case
            hf = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)
            torch.testing.assert_close(hf(ids).logits, with_float32_scales(ours)(ids).logits, atol=1e-5, rtol=1e-5)
