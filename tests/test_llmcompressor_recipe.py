"""llm-compressor recipes: translated into the ptq Recipe they mean, run end to end, and
refused by field name where ptq has no counterpart.

The recipes below are written from llm-compressor's published examples and test recipes
(examples/quantization_w4a16, quantization_w8a8_int8, quantization_w8a8_fp8, awq,
quantization_kv_cache; tests/e2e/recipes): the same modifiers and fields.
"""

import copy

import pytest
import yaml

import ptq
from ptq.cli import main
from ptq.errors import PtqError
from ptq.kv.scheme import KVCacheScheme
from ptq.llmcompressor_recipe import is_llmcompressor_recipe, translate
from ptq.modules import QuantLinear
from ptq.pipeline import cast_parameters_
from ptq.recipe import AWQStep, Calibration, GPTQStep, Recipe, RTNStep, SmoothQuantStep, load_recipe, parse_recipe
from ptq.schemes import PRESETS, QuantArgs, Scheme
from tests.test_recipes_e2e import RECIPES, few_samples

# what every translation calibrates with: llm-compressor calibrates a layer's Linears together
CALIBRATION = Calibration(true_sequential=False)

W4A16_GPTQ = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      targets: Linear
      scheme: W4A16
      ignore: [lm_head]
"""

W8A8_SMOOTHQUANT_GPTQ = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
    GPTQModifier:
      targets: Linear
      scheme: W8A8
      ignore: [lm_head]
"""

W8A8_SMOOTHQUANT_MAPPINGS = """
quant_stage:
  quant_modifiers:
    SmoothQuantModifier:
      smoothing_strength: 0.8
      mappings:
      - - ['re:.*q_proj', 're:.*k_proj', 're:.*v_proj']
        - re:.*input_layernorm
      - - ['re:.*gate_proj', 're:.*up_proj']
        - re:.*post_attention_layernorm
    GPTQModifier:
      targets: [Linear]
      ignore: [lm_head]
      scheme: W8A8
"""

FP8_DYNAMIC = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      targets: Linear
      scheme: FP8_DYNAMIC
      ignore: [lm_head]
"""

# the AWQ example as llm-compressor wrote it before AWQ became a transform (it quantized too) ...
AWQ_W4A16_ASYM = """
quant_stage:
  quant_modifiers:
    AWQModifier:
      ignore: [lm_head]
      scheme: W4A16_ASYM
      targets: [Linear]
      duo_scaling: both
"""

# ... and as now: AWQ, then the quantization modifier (tests/e2e/recipes/WNA16/recipe_w4a16_awq_asym.yaml)
AWQ_THEN_QUANTIZATION = """
quant_stage:
  quant_modifiers:
    AWQModifier:
      duo_scaling: "both"
    QuantizationModifier:
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {num_bits: 4, type: int, symmetric: false, strategy: "group", group_size: 128}
          targets: [Linear]
"""

CONFIG_GROUPS_ACTORDER = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      actorder: "group"
      block_size: 64
      dampening_frac: 0.05
      offload_hessians: true
      config_groups:
        group_0:
          weights:
            num_bits: 4
            type: "int"
            symmetric: true
            strategy: "group"
            group_size: 128
          targets: ["Linear"]
"""

FP8_KV = """
quant_stage:
    quant_modifiers:
        QuantizationModifier:
            ignore: ["lm_head"]
            config_groups:
                group_0:
                    weights: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}
                    input_activations: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true,
                                        observer: static_minmax}
                    targets: ["Linear"]
            kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}
"""

KV_HEAD_GPTQ = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      ignore: ["lm_head"]
      actorder: null
      config_groups:
        group_0:
          weights: {num_bits: 4, type: "int", symmetric: true, strategy: "channel", actorder: False}
          targets: ["Linear"]
      kv_cache_scheme: {num_bits: 8, type: float, symmetric: true, strategy: attn_head}
"""

KV_ONLY = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      kv_cache_scheme: {num_bits: 8, type: float, symmetric: true, strategy: tensor}
"""


def _translated(text: str) -> tuple[Recipe, list[str]]:
    return translate(yaml.safe_load(text), "llm-compressor recipe 'test.yaml'")


def _gptq(scheme: str, **options) -> GPTQStep:
    return GPTQStep(scheme=PRESETS[scheme], targets=["Linear"], ignore=["lm_head"], scales="original",
                    observer="minmax", **options)


SMOOTHQUANT_MAPPINGS = [
    {"smooth": "re:.*input_layernorm", "balance": ["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"]},
    {"smooth": "re:.*post_attention_layernorm", "balance": ["re:.*gate_proj", "re:.*up_proj"]},
]
W4A16_ASYM_RTN = RTNStep(scheme=PRESETS["W4A16_ASYM"], targets=["Linear"], ignore=["lm_head"], observer="minmax")
FP8_STATIC = Scheme(weights=QuantArgs(num_bits=8, type="float", strategy="tensor"),
                    input_activations=QuantArgs(num_bits=8, type="float", strategy="tensor"))

EXPECTED = {
    "w4a16-gptq": (W4A16_GPTQ, Recipe(calibration=CALIBRATION, steps=[_gptq("W4A16", actorder="static")])),
    "w8a8-smoothquant-gptq": (W8A8_SMOOTHQUANT_GPTQ, Recipe(calibration=CALIBRATION, steps=[
        SmoothQuantStep(alpha=0.8), _gptq("W8A8", actorder="static")])),
    "w8a8-smoothquant-mappings": (W8A8_SMOOTHQUANT_MAPPINGS, Recipe(calibration=CALIBRATION, steps=[
        SmoothQuantStep(alpha=0.8, mappings=SMOOTHQUANT_MAPPINGS), _gptq("W8A8", actorder="static")])),
    "fp8-dynamic": (FP8_DYNAMIC, Recipe(calibration=CALIBRATION, steps=[
        RTNStep(scheme=PRESETS["FP8_DYNAMIC"], targets=["Linear"], ignore=["lm_head"])])),
    "awq-w4a16-asym": (AWQ_W4A16_ASYM, Recipe(calibration=CALIBRATION, steps=[
        AWQStep(duo_scaling="both", clip=False, loss="module"), W4A16_ASYM_RTN])),
    "awq-then-quantization": (AWQ_THEN_QUANTIZATION, Recipe(calibration=CALIBRATION, steps=[
        AWQStep(duo_scaling="both", clip=False, loss="module"), W4A16_ASYM_RTN])),
    "config-groups-actorder": (CONFIG_GROUPS_ACTORDER, Recipe(calibration=CALIBRATION, steps=[
        _gptq("W4A16", actorder="group", block_size=64, damp=0.05)])),
    "fp8-kv": (FP8_KV, Recipe(calibration=CALIBRATION, steps=[
        RTNStep(scheme=FP8_STATIC, targets=["Linear"], ignore=["lm_head"])],
        kv_cache=KVCacheScheme(scheme="FP8", strategy="tensor"))),
    "kv-head-gptq": (KV_HEAD_GPTQ, Recipe(calibration=CALIBRATION, steps=[
        GPTQStep(scheme=Scheme(weights=QuantArgs(num_bits=4, strategy="channel")), ignore=["lm_head"],
                 actorder="none", scales="original", observer="minmax")],
        kv_cache=KVCacheScheme(scheme="FP8", strategy="head"))),
    "kv-only": (KV_ONLY, Recipe(calibration=CALIBRATION, kv_cache=KVCacheScheme(scheme="FP8", strategy="tensor"))),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_translates_to_the_expected_recipe(name):
    text, expected = EXPECTED[name]
    recipe, notes = _translated(text)
    assert recipe == expected
    assert recipe.to_yaml() == expected.to_yaml()
    assert parse_recipe(yaml.safe_load(recipe.to_yaml())) == recipe  # the converted file reads back the same
    assert notes and all(isinstance(note, str) and "\n" not in note for note in notes)


def test_w8a16_is_compressed_tensors_preset_not_ptqs():
    """llm-compressor's W8A16 is compressed-tensors' (groups of 128); ptq's own W8A16 preset is per channel."""
    recipe, _ = _translated("q_stage:\n  q_modifiers:\n    QuantizationModifier: {scheme: W8A16}\n")
    weights = recipe.weight_step.scheme.weights
    assert (weights.num_bits, weights.strategy, weights.group_size) == (8, "group", 128)
    assert recipe.weight_step.ignore == []  # llm-compressor ignores nothing unless told


def test_recipe_forms_agree():
    """A stage of modifier groups, the older top-level group, and a group as a list of modifiers."""
    stage, _ = _translated(W8A8_SMOOTHQUANT_GPTQ)
    flat = {"quant_modifiers": {"SmoothQuantModifier": {"smoothing_strength": 0.8},
                                "GPTQModifier": {"targets": "Linear", "scheme": "W8A8", "ignore": ["lm_head"]}}}
    listed = {"quant_stage": {"quant_modifiers": [{k: v} for k, v in flat["quant_modifiers"].items()]}}
    two_stages = {"smooth_stage": {"smooth_modifiers": {"SmoothQuantModifier": {"smoothing_strength": 0.8}}},
                  "quant_stage": {"quant_modifiers": {"GPTQModifier": flat["quant_modifiers"]["GPTQModifier"]}}}
    for data in (flat, listed, two_stages):
        assert translate(data)[0] == stage


def test_same_scheme_groups_merge_their_targets():
    text = """
quant_stage:
  quant_modifiers:
    QuantizationModifier:
      config_groups:
        attention: {targets: ['re:.*self_attn.*'], weights: {num_bits: 4, strategy: group, group_size: 128}}
        mlp: {targets: ['re:.*mlp.*'], weights: {num_bits: 4, strategy: group, group_size: 128}}
"""
    step = _translated(text)[0].weight_step
    assert step.targets == ["re:.*self_attn.*", "re:.*mlp.*"] and step.scheme == PRESETS["W4A16"]


def test_mapping_patterns():
    """Model-level patterns become block-relative ones that match the same modules in each block."""
    text = """
quant_stage:
  quant_modifiers:
    AWQModifier:
      mappings:
        - smooth_layer: "re:.*input_layernorm$"
          balance_layers: ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]
        - smooth_layer: "re:^.*\\\\.up_proj$"
          balance_layers: ["re:.*down_proj$"]
        - smooth_layer: LlamaRMSNorm
          balance_layers: ["re:.*experts.*.gate_proj$"]
    QuantizationModifier: {scheme: W4A16}
"""
    awq = _translated(text)[0].steps[0]
    assert awq.mappings == [
        {"smooth": "re:.*input_layernorm$", "balance": ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]},
        {"smooth": "re:(.*\\.)?up_proj$", "balance": ["re:.*down_proj$"]},  # also a direct child of the block
        {"smooth": "LlamaRMSNorm", "balance": ["re:.*experts.*.gate_proj$"]},
    ]


@pytest.mark.parametrize("field", ["offload_hessians", "sequential_targets", "group", "GPTQModifier: scales: original"])
def test_fields_without_effect_are_named_in_the_notes(field):
    text = W4A16_GPTQ + "      offload_hessians: true\n      sequential_targets: [LlamaDecoderLayer]\n      group: quant\n"
    recipe, notes = _translated(text)
    assert recipe.weight_step == _gptq("W4A16", actorder="static")
    assert any(field in note for note in notes)


def _gptq_with(fields: str) -> str:
    return W4A16_GPTQ.replace("      scheme: W4A16\n", "") + "".join(f"      {line}\n" for line in fields.split("; "))


REFUSED = [
    ("quant_stage:\n  quant_modifiers:\n    SparseGPTModifier: {sparsity: 0.5}\n", "SparseGPTModifier: ptq has no counterpart"),
    (W4A16_GPTQ + "      foo: 1\n", "GPTQModifier.foo: unknown field"),
    (W4A16_GPTQ + "      bypass_divisibility_checks: true\n", "GPTQModifier.bypass_divisibility_checks:"),
    (W4A16_GPTQ + "      dampening_frac: null\n", "GPTQModifier.dampening_frac:"),
    (W4A16_GPTQ + "      block_size: 0\n", "GPTQModifier.block_size:"),
    (W4A16_GPTQ + "      start: 0.5\n", "GPTQModifier.start:"),
    (W4A16_GPTQ + "      output_observer: minmax\n", "GPTQModifier.output_observer:"),
    (W4A16_GPTQ + "      weight_observer: imatrix_mse\n", "scheme[W4A16].weights.observer: 'imatrix_mse'"),
    (W4A16_GPTQ + "      config_groups: {group_0: {targets: [Linear], weights: {num_bits: 4}}}\n",
     "GPTQModifier.scheme: give scheme or config_groups"),
    (W4A16_GPTQ.replace("W4A16", "NVFP4"), "scheme[NVFP4].weights.strategy: 'tensor_group'"),
    (W4A16_GPTQ.replace("W4A16", "FP8_BLOCK"), "scheme[FP8_BLOCK].weights.block_structure"),
    (W4A16_GPTQ.replace("W4A16", "W9A9"), "scheme[W9A9]: 'W9A9' is not a compressed-tensors preset"),
    (_gptq_with("actorder: weight; config_groups: {g: {targets: [Linear], weights: "
                "{num_bits: 4, strategy: group, group_size: 128, actorder: group}}}"), "GPTQModifier.actorder:"),
    (_gptq_with("config_groups: {g: {targets: [Linear], weights: {num_bits: 4, strategy: group, group_size: 128}, "
                "output_activations: {num_bits: 8}}}"), "config_groups.g.output_activations:"),
    (_gptq_with("config_groups: {g: {targets: [Linear], weights: {num_bits: 4, strategy: group, group_size: 128, "
                "observer_kwargs: {maxshrink: 0.5}}}}"), "config_groups.g.weights.observer_kwargs:"),
    (_gptq_with("config_groups: {g: {targets: [Linear], weights: {num_bits: 4, strategy: group, group_size: 128, "
                "scale_dtype: float16}}}"), "config_groups.g.weights.scale_dtype:"),
    (_gptq_with("config_groups: {a: {targets: ['re:.*mlp.*'], weights: {num_bits: 4, strategy: group, group_size: 128}}, "
                "b: {targets: ['re:.*self_attn.*'], weights: {num_bits: 8, strategy: channel}}}"),
     "config_groups.b: its scheme differs from"),
    (_gptq_with("config_groups: {g: {targets: [Linear], weights: {num_bits: 8, strategy: channel}, input_activations: "
                "{num_bits: 8, symmetric: false, dynamic: true, strategy: token}}}"),
     "config_groups.g: ptq cannot run this scheme:"),
    (W4A16_GPTQ + "      kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: true}\n",
     "kv_cache_scheme.dynamic:"),
    (W4A16_GPTQ + "      kv_cache_scheme: {num_bits: 4, type: int, strategy: tensor}\n", "kv_cache_scheme: int4"),
    (W4A16_GPTQ + "      kv_cache_scheme: {num_bits: 8, type: float, strategy: channel}\n", "kv_cache_scheme.strategy:"),
    (W8A8_SMOOTHQUANT_GPTQ.replace("smoothing_strength: 0.8", "smoothing_strength: 1.0"),
     "SmoothQuantModifier.smoothing_strength:"),
    (W8A8_SMOOTHQUANT_GPTQ.replace("smoothing_strength: 0.8", "algorithm: log_equalization"),
     "SmoothQuantModifier.algorithm:"),
    (W8A8_SMOOTHQUANT_GPTQ.replace("smoothing_strength: 0.8", "ignore: [model.layers.0.input_layernorm]"),
     "SmoothQuantModifier.ignore:"),
    (W8A8_SMOOTHQUANT_MAPPINGS.replace("re:.*input_layernorm", "model.layers.0.input_layernorm"),
     "SmoothQuantModifier.mappings.0: 'model.layers.0.input_layernorm' names one module"),
    (W8A8_SMOOTHQUANT_MAPPINGS.replace("re:.*input_layernorm", "re:model\\.layers\\.\\d+\\.input_layernorm"),
     "SmoothQuantModifier.mappings.0: 're:model"),
    (W8A8_SMOOTHQUANT_MAPPINGS.replace("re:.*input_layernorm", "re:.*layers\\.0\\.input_layernorm"),
     "names modules by their path from the model's root"),
    ("q_stage:\n  q_modifiers:\n    AWQModifier:\n      mappings: [{smooth_layer: 're:.*input_layernorm$', "
     "balance_layers: ['re:.*q_proj$'], activation_hook_target: mlp}]\n    QuantizationModifier: {scheme: W4A16}\n",
     "AWQModifier.mappings.0.activation_hook_target:"),
    ("q_stage:\n  q_modifiers:\n    AWQModifier: {duo_scaling: true}\n", "AWQModifier: AWQ needs a quantization modifier"),
    ("q_stage:\n  q_modifiers:\n    GPTQModifier: {scheme: W4A16}\n    SmoothQuantModifier: {}\n",
     "SmoothQuantModifier: comes after"),
    # tests/e2e/recipes/non_uniform/recipe_gptq_awq.yaml: two schemes for two sets of Linears
    ("q_stage:\n  q_modifiers:\n    QuantizationModifier: {scheme: W4A16, targets: ['re:.*self_attn.*']}\n"
     "    GPTQModifier: {scheme: W8A8, targets: ['re:.*mlp.*']}\n", "GPTQModifier: quantizes weights, and so does"),
    ("q_stage:\n  q_modifiers:\n    GPTQModifier: {scheme: W4A16}\nsteps: []\n", "steps: not a part of"),
    ("q_stage:\n  q_modifiers:\n    QuantizationModifier: {}\n", "the recipe quantizes nothing"),
    ("args: {bits: 4}\n" + W4A16_GPTQ, "args: recipe variables are not read"),
]


@pytest.mark.parametrize("text, message", REFUSED, ids=[m for _, m in REFUSED])
def test_unsupported_fields_are_refused_by_name(text, message):
    with pytest.raises(PtqError) as error:
        _translated(text)
    line = str(error.value)
    assert "\n" not in line and line.startswith("llm-compressor recipe 'test.yaml': ")
    assert message in line


def test_ptq_recipes_are_not_llmcompressor_recipes():
    assert RECIPES
    for path in RECIPES:
        data = yaml.safe_load(path.read_text())
        assert not is_llmcompressor_recipe(data)
        with pytest.raises(PtqError, match="not an llm-compressor recipe"):
            translate(data)


def test_mse_observer_carries_over_with_a_note():
    recipe, notes = _translated(W4A16_GPTQ + "      weight_observer: mse\n")
    assert recipe.weight_step == _gptq("W4A16", actorder="static").model_copy(update={"observer": "mse"})
    assert any("weights.observer mse" in note for note in notes)


def test_load_recipe_translates_files(tmp_path):
    path = tmp_path / "llmc.yaml"
    path.write_text(W4A16_GPTQ)
    assert load_recipe(path) == EXPECTED["w4a16-gptq"][1]
    path.write_text(W4A16_GPTQ + "      foo: 1\n")
    with pytest.raises(PtqError, match=r"^llm-compressor recipe '.*llmc.yaml': quant_stage.quant_modifiers.GPTQModifier.foo"):
        load_recipe(path)


# AWQ with its own mappings (as the e2e recipe) and the smoothing mappings above: the
# pattern translation meets the bundled Llama's module names
AWQ_MAPPINGS_ASYM = """
quant_stage:
  quant_modifiers:
    AWQModifier:
      duo_scaling: true
      mappings:
        - smooth_layer: "re:.*input_layernorm$"
          balance_layers: ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]
        - smooth_layer: "re:.*up_proj$"
          balance_layers: ["re:.*down_proj$"]
    QuantizationModifier:
      ignore: [lm_head]
      scheme: W4A16_ASYM
"""


@pytest.mark.parametrize("text", [W8A8_SMOOTHQUANT_MAPPINGS, AWQ_MAPPINGS_ASYM, FP8_KV],
                         ids=["smoothquant-gptq-w8a8", "awq-w4a16-asym", "fp8-kv"])
def test_translated_recipe_runs_end_to_end(text):
    recipe = few_samples(_translated(text)[0])
    model, tokenizer = ptq.load_model()
    reference = copy.deepcopy(model)
    ptq.quantize(model, recipe, tokenizer=tokenizer, show_progress=False)
    assert model.ptq_report.recipe == recipe
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 4 * 7 and "lm_head" not in quantized  # 4 blocks of q, k, v, o, gate, up, down
    assert all(m.scheme == recipe.weight_step.scheme for m in quantized.values())
    if recipe.kv_cache is not None:
        assert model.ptq_kv.spec == recipe.kv_cache
    # a quality floor: these schemes stay close to the original (measured: KL 0.001 to 0.011)
    cast_parameters_(reference, model.ptq_report.compute_dtype)
    windows = ptq.eval_windows(tokenizer, seq_len=128, max_windows=2)
    result = ptq.evaluate(model, windows, reference=reference, show_progress=False)
    assert result.kl < 0.05 and result.top1 > 0.85


# --- the command line -----------------------------------------------------------------


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_convert_prints_and_writes(capsys, tmp_path):
    source = tmp_path / "llmc.yaml"
    source.write_text(CONFIG_GROUPS_ACTORDER)
    code, out, err = run_cli(capsys, "recipe", "convert", source)
    assert code == 0 and err == ""
    assert out.startswith("# ptq recipe translated from the llm-compressor recipe") and "# note: " in out
    assert parse_recipe(yaml.safe_load(out)) == EXPECTED["config-groups-actorder"][1]

    target = tmp_path / "ptq.yaml"
    code, out, _ = run_cli(capsys, "recipe", "convert", source, target)
    assert code == 0 and f"wrote {target}" in out and "note: " in out
    assert load_recipe(target) == EXPECTED["config-groups-actorder"][1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llmc.yaml", "ptq.yaml"]  # no temporary left

    code, _, err = run_cli(capsys, "recipe", "convert", source, target)  # exists: kept unless --overwrite
    assert code == 2 and "--overwrite" in err
    source.write_text(FP8_DYNAMIC)
    assert run_cli(capsys, "recipe", "convert", source, target, "--overwrite")[0] == 0
    assert load_recipe(target) == EXPECTED["fp8-dynamic"][1]


@pytest.mark.parametrize("content, message", [
    (W4A16_GPTQ + "      offload_device: cpu\n", "GPTQModifier.offload_device: unknown field"),
    ("quant_stage:\n  quant_modifiers:\n    SparseGPTModifier: {sparsity: 0.5}\n", "SparseGPTModifier"),
    ("steps:\n  - rtn: {scheme: W4A16}\n", "is a ptq recipe, not an llm-compressor one"),
    ("quant_stage: [", "is not valid YAML"),
])
def test_cli_convert_bad_input(capsys, tmp_path, content, message):
    source, target = tmp_path / "in.yaml", tmp_path / "out.yaml"
    source.write_text(content)
    code, out, err = run_cli(capsys, "recipe", "convert", source, target)
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ptq: error: ") and message in lines[0]
    assert not target.exists()


def test_cli_convert_refuses_a_missing_input_and_a_missing_folder(capsys, tmp_path):
    code, _, err = run_cli(capsys, "recipe", "convert", tmp_path / "none.yaml")
    assert code == 2 and "not found" in err
    source = tmp_path / "in.yaml"
    source.write_text(W4A16_GPTQ)
    code, _, err = run_cli(capsys, "recipe", "convert", source, tmp_path / "no" / "out.yaml")
    assert code == 2 and "does not exist" in err and err.count("\n") == 1


def test_cli_quantize_prints_the_translation(capsys, tmp_path, user_model_dir):
    source, out = tmp_path / "llmc.yaml", tmp_path / "out"
    source.write_text(FP8_DYNAMIC.replace("FP8_DYNAMIC", "W4A16"))  # round to nearest: no calibration data
    code, stdout, _ = run_cli(capsys, "quantize", "--recipe", source, "--model", user_model_dir, "--output", out,
                              "--no-eval")
    assert code == 0 and (out / "config.json").exists()
    assert f"llm-compressor recipe '{source}' translated into this ptq recipe:" in stdout
    assert "  - rtn:" in stdout and "note: ptq runs its own algorithms" in stdout
    assert stdout.index("translated into") < stdout.index(f"wrote {out}")
