"""Every dense model family users run, each on a tiny random model (hidden 128, 2 layers):
quantized with each algorithm it supports, saved, loaded back by ptq.load to the same bits
(logits torch.equal with the quantized model in memory), and loaded by transformers
through compressed-tensors to the same logits within 1e-5 (float32; see `_transformers`).

`FAMILIES` is what the README's table of supported families says: scripts/families_table.py
prints that table from it, so the table states what these tests cover and nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from compressed_tensors.utils.match import is_match
from torch import nn
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

import ptq
from ptq.errors import PtqError
from ptq.modules import QuantLinear
from ptq.recipe import parse_recipe
from ptq.targets import matches
from tests.conftest import VOCAB, load_script, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")  # dequantize=True

ALGORITHMS = ("rtn", "gptq", "awq", "smoothquant")  # AWQ then RTN W4A16; SmoothQuant then RTN W8A8


@dataclass(frozen=True)
class Family:
    name: str  # as users know it
    model_class: str  # the transformers class
    configs: tuple[str, ...]  # tiny_config names (tests/conftest.py), shaped as the released models
    algorithms: tuple[str, ...] = ALGORITHMS
    pairs: int = 0  # smoothing pairs (AWQ, SmoothQuant) per block of the tiny config
    # how transformers' from_pretrained reads the W4A16 checkpoints: "yes" (as is: the same
    # logits), "dequantized" (through the dequantize path, which the checkpoint asks for: the same
    # weights and logits), "weights" (the same weights, but it computes another model), "no"
    transformers: str = "yes"
    transformers_w8a8: str = "yes"  # the same for W8A8 (int8 weights and activations)
    note: str = ""


GQA = "v_proj -> o_proj only without grouped-query attention"
PER_TENSOR = (
    "transformers (compressed-tensors outside vLLM) quantizes the 2-D activations of fc1/fc2 per "
    "tensor instead of per token, so it computes another model; ptq, as vLLM, per token"
)
FAMILIES: tuple[Family, ...] = (
    Family("Llama 2", "LlamaForCausalLM", ("llama",), pairs=3, note=GQA),
    Family("Llama 3, 3.1, 3.2", "LlamaForCausalLM", ("llama3",), pairs=3,
           note="llama3 rope scaling, tied embeddings (3.2); " + GQA),
    Family("Mistral", "MistralForCausalLM", ("mistral",), pairs=3, note=GQA),
    Family("Qwen2, Qwen2.5", "Qwen2ForCausalLM", ("qwen2.5",), pairs=3, note="tied embeddings (0.5B-3B); " + GQA),
    Family("Qwen3", "Qwen3ForCausalLM", ("qwen3",), pairs=3, note=GQA),
    Family("Gemma 2", "Gemma2ForCausalLM", ("gemma2",), pairs=3,
           note="x̂·(1 + w) norms: smoothing divides 1 + w; pre_feedforward_layernorm feeds the MLP"),
    Family("Gemma 3 (text)", "Gemma3ForCausalLM", ("gemma3",), pairs=3, note="as Gemma 2"),
    Family("Phi-3", "Phi3ForCausalLM", ("phi3",), pairs=4,
           note="fused qkv_proj, gate_up_proj: their v and up parts are smoothed too (v only without "
                "grouped-query attention, as Phi-3-mini)"),
    Family("OPT", "OPTForCausalLM", ("opt",), pairs=3, transformers_w8a8="weights",
           note="pre-norm models (not opt-350m); W8A8: " + PER_TENSOR),
    Family("Falcon", "FalconForCausalLM", ("falcon",), pairs=1, transformers="dequantized",
           note="W4A16: transformers' Falcon code reads each Linear's dense weight while loading, so "
                "the checkpoint asks for the dequantize path (`dequantize: true`): the default "
                "from_pretrained gives the same weights"),
    Family("GPT-2", "GPT2LMHeadModel", ("gpt2",), algorithms=(), transformers="no", transformers_w8a8="no",
           note="refused: its Linears are transformers Conv1D ([in, out]), which compressed-tensors "
                "does not quantize; transformers would load such a checkpoint with random weights"),
)
BY_CONFIG = {config: family for family in FAMILIES for config in family.configs}

CALIBRATION = {"samples": 2, "seq_len": 16}  # small: these tests check the families, not quality
STEPS = {
    "rtn": [{"rtn": {"scheme": "W4A16"}}],
    "gptq": [{"gptq": {"scheme": "W4A16"}}],
    "awq": [{"awq": {"n_grid": 4}}, {"rtn": {"scheme": "W4A16"}}],
    "smoothquant": [{"smoothquant": {"alpha": 0.5}}, {"rtn": {"scheme": "W8A8"}}],
}
DATA = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))  # [samples, seq_len]
IDS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))  # [batch, seq]
CASES = [(config, algorithm) for f in FAMILIES for config in f.configs for algorithm in f.algorithms]


def quantize_(model: nn.Module, algorithm: str) -> nn.Module:
    recipe = parse_recipe({"calibration": CALIBRATION, "steps": STEPS[algorithm]})
    # float32 compute from a bf16 model, as on CPUs without fast bf16 (and as ptq.load(dtype=float32))
    return ptq.quantize(model, recipe, data=DATA, dtype=torch.float32, show_progress=False)


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits


@pytest.mark.parametrize("config, algorithm", CASES, ids=[f"{c}-{a}" for c, a in CASES])
def test_quantize_save_load(tmp_path, config, algorithm):
    family = BY_CONFIG[config]
    model = tiny_model(config)
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head")
    quantize_(model, algorithm)
    report = model.ptq_report
    assert sorted(report.layers) == linears  # all of them, each quantized by the weight step
    assert set(report.layers.values()) == {"gptq" if algorithm == "gptq" else "rtn"}
    if algorithm in ("awq", "smoothquant"):  # the table's pairs in both blocks, each smoothed
        done = list(report.smoothing.values())
        assert len(done) == 2 * family.pairs and all(what.startswith(algorithm) for what in done)
    ptq.save(model, tmp_path / "q")
    loaded = ptq.load(tmp_path / "q", dtype=torch.float32)
    assert torch.equal(logits(loaded), logits(model))  # bit-exact
    weight_only = algorithm != "smoothquant"
    _transformers(tmp_path / "q", loaded, family.transformers if weight_only else family.transformers_w8a8,
                  weight_only=weight_only)


def _transformers(path, ours: nn.Module, mode: str, *, weight_only: bool) -> None:
    """transformers' model from the checkpoint computes what ptq.load's does, in float32.

    Loaded as is (compressed), transformers dequantizes in the activation dtype rather than
    in the bf16 scale dtype: ptq's model with float32 scales computes exactly that, and the
    int8 activations (W8A8) are quantized alike: logits equal within 1e-5 (summation order).
    With dequantize=True ("dequantized", "weights") the weights are dense and equal to
    ptq's dequantized ones, and the activations are not quantized, so logits are compared for
    weight-only schemes only.
    """
    dequantize = mode in ("dequantized", "weights")
    options = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **options).eval()
    for name, module in ours.named_modules():
        if isinstance(module, QuantLinear):
            if dequantize:
                assert torch.equal(theirs.get_submodule(name).weight, module.dequantized_weight().float()), name
            else:
                module.weight_scale = module.weight_scale.float()
    for name, buffer in ours.named_buffers():
        if name.endswith("embed_scale"):
            # Gemma's sqrt(hidden), computed when the model is built: transformers builds in
            # float32 here, ptq (as the model it quantized) in bf16, 11.3125 for 11.3137
            theirs.get_buffer(name).copy_(buffer)
    if mode != "weights" and (weight_only or not dequantize):
        torch.testing.assert_close(logits(theirs), logits(ours), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# Falcon: FalconLinear is an nn.Linear subclass; GPT-2: Conv1D is refused


def test_targets_match_by_class_hierarchy_as_compressed_tensors_does():
    model = tiny_model("falcon")
    patterns = [["Linear"], ["FalconLinear"], ["re:.*dense$"], ["lm_head"], ["Embedding"], ["Module"], []]
    for name, module in model.named_modules():
        for pattern in patterns:
            assert matches(name, module, pattern) == (bool(pattern) and is_match(name, module, pattern))
    qkv = model.transformer.h[0].self_attention.query_key_value
    assert type(qkv).__name__ == "FalconLinear"
    assert matches("x", qkv, ["Linear"]) and matches("x", qkv, ["FalconLinear"])
    assert not matches("x", nn.Linear(2, 2), ["FalconLinear"])


def test_falcon_with_falcon_linear_targets(tmp_path):
    recipe = parse_recipe({"steps": [{"rtn": {"scheme": "W4A16", "targets": ["FalconLinear"]}}]})
    model = ptq.quantize(tiny_model("falcon"), recipe, dtype=torch.float32, show_progress=False)
    assert len(model.ptq_report.layers) == 8  # 4 FalconLinears per block; lm_head is an nn.Linear
    ptq.save(model, tmp_path / "q")
    loaded = ptq.load(tmp_path / "q", dtype=torch.float32)
    assert torch.equal(logits(loaded), logits(model))
    _transformers(tmp_path / "q", loaded, BY_CONFIG["falcon"].transformers, weight_only=True)


def test_falcon_default_transformers_load(tmp_path):
    """FalconPreTrainedModel._init_weights reads FalconLinear.weight, which compressed-tensors
    replaced by weight_packed: the checkpoint asks for the dequantize path itself."""
    model = quantize_(tiny_model("falcon"), "rtn")
    ptq.save(model, tmp_path / "q")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32)  # no options
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            assert torch.equal(theirs.get_submodule(name).weight, module.dequantized_weight().float()), name


def test_gpt2_is_refused_in_one_line():
    model = tiny_model("gpt2")
    with pytest.raises(PtqError) as error:
        ptq.quantize(model, "W4A16", show_progress=False)
    message = str(error.value)
    assert message.startswith("GPT2LMHeadModel computes with transformers Conv1D layers")
    assert "ptq cannot quantize this model" in message and "\n" not in message
    assert not any(isinstance(m, QuantLinear) for m in model.modules())  # the model is untouched


def test_the_readme_table_says_what_these_tests_cover():
    rows = load_script("families_table").families_table().splitlines()[2:]
    assert len(rows) == len(FAMILIES)
    for row, family in zip(rows, FAMILIES):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[0] == family.name and cells[1] == f"`{family.model_class}`"
        assert [a for a, cell in zip(ALGORITHMS, cells[2:6]) if cell == "✓"] == list(family.algorithms)
