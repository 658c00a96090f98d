"""Recipes: every bundled recipe loads; bad ones are rejected with one line naming the problem."""

import time
from pathlib import Path

import pytest

from ptq.errors import PtqError
from ptq.recipe import GPTQStep, Recipe, RTNStep, load_recipe, parse_recipe
from ptq.schemes import PRESETS

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


def test_recipes_folder_not_empty():
    assert len(RECIPES) >= 2


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    # what a checkpoint records reads back as the same recipe
    import yaml

    assert parse_recipe(yaml.safe_load(recipe.to_yaml())) == recipe


def test_preset_name_is_an_rtn_recipe():
    recipe = load_recipe("W8A16")
    assert isinstance(recipe.weight_step, RTNStep) and recipe.weight_step.scheme == PRESETS["W8A16"]


def test_gptq_defaults():
    step = parse_recipe({"steps": [{"gptq": {"scheme": "W4A16"}}]}).weight_step
    assert isinstance(step, GPTQStep)
    assert (step.block_size, step.damp, step.actorder, step.scales) == (128, 0.01, "static", "updated")


@pytest.mark.parametrize(
    "data,message",
    [
        ({"steps": [{"rtn": {"scheme": "W4A16", "colour": 1}}]},
         "steps.0.rtn: unknown key 'colour'; allowed keys here: scheme, targets, ignore"),
        ({"steps": [{"rtn": {"scheme": "W4A16"}}], "calibraton": {}},
         "unknown key 'calibraton'; allowed keys here: calibration, steps"),
        ({"steps": [{"rtn": {"scheme": "W5A16"}}]}, "unknown preset 'W5A16'; choose one of W4A16"),
        ({"steps": [{"rtn": {"scheme": {"weights": {"num_bits": 9, "strategy": "channel"}}}}]},
         "scheme.weights.num_bits: Input should be less than or equal to 8 (got 9)"),
        ({"steps": [{"rtn": {"scheme": {"weights": {"num_bits": 0, "strategy": "channel"}}}}]},
         "scheme.weights.num_bits: Input should be greater than or equal to 1 (got 0)"),
        ({"steps": [{"gptq": {"scheme": "W4A16", "block_size": "big"}}]},
         "block_size: Input should be a valid integer"),
        ({"steps": [{"gptq": {"scheme": "W4A16", "actorder": "random"}}]},
         "actorder: Input should be 'none', 'static' or 'group' (got 'random')"),
        ({"steps": [{"magic": {}}]}, "unknown step 'magic'; allowed: rtn, gptq"),
        ({"steps": []}, "the recipe quantizes nothing: give steps"),
        ({}, "the recipe quantizes nothing: give steps"),
        ({"calibration": {"samples": 0}, "steps": [{"rtn": {"scheme": "W4A16"}}]},
         "calibration.samples: Input should be greater than or equal to 1 (got 0)"),
        ({"calibration": {"samples": "many"}, "steps": [{"rtn": {"scheme": "W4A16"}}]},
         "calibration.samples: Input should be a valid integer"),
        (["rtn"], "a recipe is a YAML mapping"),
    ],
)
def test_bad_recipes(data, message):
    with pytest.raises(PtqError) as error:
        parse_recipe(data, "r.yaml")
    text = str(error.value)
    assert message in text and "\n" not in text


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(PtqError, match="recipe file '.*nope.yaml' not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps:\n  - rtn: {scheme: W4A16\n")
    with pytest.raises(PtqError, match="is not valid YAML at line"):
        load_recipe(bad)


W4 = {"rtn": {"scheme": "W4A16"}}


@pytest.mark.parametrize(
    "data,message",
    [
        # schemes that would quantize to garbage
        ({"steps": [{"rtn": {"scheme": {"weights": {"num_bits": 1, "strategy": "channel"}}}}]},
         "steps.0.rtn: scheme.weights: type 'int' needs num_bits 2..8, not 1"),
        ({"steps": [{"gptq": {"scheme": {"weights": {"num_bits": 8, "strategy": "tensor"},
                                         "input_activations": {"num_bits": 8, "strategy": "tensor"}}}}]},
         "steps.0.gptq: GPTQ quantizes int weights per channel or group, not per tensor"),
        ({"steps": [{"gptq": {"scheme": "W8A16", "actorder": "group"}}]},
         "steps.0.gptq: actorder 'group' orders the groups of strategy 'group'"),
        ({"steps": [{"awq": {}}, {"rtn": {"scheme": "FP8"}}]},
         "steps.0.awq: clip searches ranges of int weights per group or channel, not float per tensor; set clip: false"),
        # invalid regexes are caught on load, not deep inside quantization
        ({"steps": [{"rtn": {"scheme": "W4A16", "targets": ["Linear", "re:("]}}]},
         "steps.0.rtn: targets: invalid regex 're:(': missing ), unterminated subpattern at position 0"),
        ({"steps": [{"rtn": {"scheme": "W4A16", "ignore": ["re:[a-"]}}]}, "ignore: invalid regex 're:[a-'"),
        ({"steps": [{"rtn": {"scheme": "W4A16", "ignore": ["re:" + "(" * 5000]}}]},
         "invalid regex 're:((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((...'"),
        # sizes and seeds within what can run
        ({"calibration": {"seed": -1}, "steps": [W4]}, "calibration.seed: Input should be greater than or equal to 0"),
        ({"calibration": {"seed": 2**64}, "steps": [W4]},
         "calibration.seed: Input should be less than or equal to 18446744073709551615"),
        ({"calibration": {"seed": "1e23"}, "steps": [W4]},  # as PyYAML reads `seed: 1e23`
         "calibration.seed: Input should be a valid integer, unable to parse string as an integer (got '1e23')"),
        ({"calibration": {"seed": 1e23}, "steps": [W4]}, "calibration.seed: "),  # YAML `1.0e+23`
        ({"calibration": {"samples": 1_000_000_000}, "steps": [W4]},
         "calibration.samples: Input should be less than or equal to 100000 (got 1000000000)"),
        ({"calibration": {"seq_len": 10**9}, "steps": [W4]}, "calibration.seq_len: Input should be less than or equal to 1048576"),
        ({"calibration": {"samples": 100_000, "seq_len": 4096}, "steps": [W4]},
         "calibration: samples x seq_len is 409,600,000 tokens, more than ptq calibrates on (134,217,728)"),
        ({"calibration": {"split": ""}, "steps": [W4]}, "calibration.split: String should have at least 1 character"),
        ({"steps": [{"gptq": {"scheme": "W4A16", "block_size": 10**6}}]}, "block_size: Input should be less than or equal to 65536"),
        ({"steps": [{"gptq": {"scheme": "W4A16", "damp": float("nan")}}]}, "damp: Input should be a finite number"),
        ({"steps": [{"awq": {"n_grid": 10**6}}, W4]}, "steps.0.awq: n_grid: Input should be less than or equal to 1000"),
        ({"steps": [{"awq": {"loss": "linar"}}, W4]}, "steps.0.awq: loss: Input should be 'module' or 'linear' (got 'linar')"),
        ({"steps": [{"smoothquant": {"alpha": float("nan")}}, W4]}, "alpha: Input should be a finite number"),
        # the shape of smoothing mappings
        ({"steps": [{"awq": {"mappings": [{"smooth": "a", "balance": ["b"], "inspct": "c"}]}}, W4]},
         "steps.0.awq: mappings.0: unknown key 'inspct'; allowed keys here: smooth, balance, inspect"),
        ({"steps": [{"awq": {"mappings": [{"smooth": "a"}]}}, W4]}, "steps.0.awq: mappings.0: balance: required field is missing"),
        ({"steps": [{"awq": {"mappings": [{"smooth": "a", "balance": "b"}]}}, W4]},
         "mappings.0: balance: Input should be a valid list (got 'b')"),
        ({"steps": [{"awq": {"mappings": [{"smooth": "a", "balance": []}]}}, W4]}, "mappings.0: balance: List should have at least 1 item"),
        ({"steps": [{"awq": {"mappings": [{"smooth": "a", "balance": [1]}]}}, W4]}, "balance.0: Input should be a valid string (got 1)"),
        ({"steps": [{"smoothquant": {"mappings": ["input_layernorm"]}}, W4]},
         "steps.0.smoothquant: mappings.0: Input should be a valid dictionary (got 'input_layernorm')"),
        ({"steps": [{"awq": {"mappings": []}}, W4]}, "steps.0.awq: mappings: List should have at least 1 item"),
        ({"steps": [{"awq": {"mappings": [{"smooth": "re:[", "balance": ["b"]}]}}, W4]},
         "mappings.0: smooth: invalid regex 're:[': unterminated character set"),
        ({"steps": [{"awq": {"mappings": [{"smooth": "a", "balance": ["b", "re:*"]}]}}, W4]},
         "mappings.0: balance: invalid regex 're:*': nothing to repeat"),
        # echoes of bad values are short
        ({"steps": [{"rtn": {"scheme": "W4A16", "targets": "x" * 10**6}}]}, "targets: Input should be a valid list (got 'xxxx"),
        ({"steps": [W4] * 1000}, "steps ['rtn', 'rtn', 'rtn', 'rtn', 'rtn', 'rtn', ...]: a recipe ends with exactly one weight"),
    ],
)
def test_recipes_that_cannot_run(data, message):
    with pytest.raises(PtqError) as error:
        parse_recipe(data, "r.yaml")
    text = str(error.value)
    assert message in text and "\n" not in text and len(text) < 400


def test_mappings_read_back_as_written():
    mapping = {"smooth": "input_layernorm", "balance": ["re:.*q_proj$", "re:.*k_proj$"], "inspect": "self_attn"}
    recipe = parse_recipe({"steps": [{"awq": {"mappings": [mapping, {"smooth": "a", "balance": ["b"]}]}}, W4]})
    assert recipe.transforms[0].mappings == [mapping, {"smooth": "a", "balance": ["b"]}]
    import yaml

    assert parse_recipe(yaml.safe_load(recipe.to_yaml())) == recipe


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
    # nine levels of nine aliases: 9**9 (387 million) strings once expanded, from ~400 bytes
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = write(tmp_path / "bomb.yaml", "\n".join(lines) + "\nsteps: [{rtn: {scheme: W4A16}}]\n")
    assert bomb.stat().st_size <= 500
    start = time.perf_counter()
    with pytest.raises(PtqError) as error:
        load_recipe(bomb)
    assert time.perf_counter() - start < 1.0
    assert "bomb.yaml' uses YAML anchors/aliases (&a0, line 1); write the values out" in str(error.value)


def test_yaml_merge_keys_are_aliases_too(tmp_path):
    recipe = write(tmp_path / "r.yaml", "base: &base {scheme: W4A16}\nsteps:\n  - rtn: {<<: *base}\n")
    with pytest.raises(PtqError, match="uses YAML anchors/aliases"):
        load_recipe(recipe)


def test_yaml_numbers_are_checked_either_way(tmp_path):
    # PyYAML reads 1e23 as a string and 1.0e+23 as a float: both are refused with the value
    with pytest.raises(PtqError, match=r"calibration.seed: .*integer.*\(got '1e23'\)"):
        load_recipe(write(tmp_path / "a.yaml", "calibration: {seed: 1e23}\nsteps: [{rtn: {scheme: W4A16}}]\n"))
    with pytest.raises(PtqError, match=r"calibration.seed: .*\(got 1e\+23\)"):
        load_recipe(write(tmp_path / "b.yaml", "calibration: {seed: 1.0e+23}\nsteps: [{rtn: {scheme: W4A16}}]\n"))
    with pytest.raises(PtqError, match="holds a value YAML cannot read: Exceeds the limit"):
        load_recipe(write(tmp_path / "c.yaml", "calibration: {seed: " + "9" * 5000 + "}\n"))


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda p: p.mkdir(), "r.yaml' is a directory, not a file; pass a YAML file"),
        (lambda p: p.write_bytes(b""), "r.yaml' is empty; a recipe is a YAML mapping with 'steps'"),
        (lambda p: p.write_bytes(b"# only a comment\n"), "r.yaml' is empty"),
        (lambda p: p.write_bytes(b"steps: [{rtn: {scheme: W4A16}}]\n# caf\xe9\n"),
         "r.yaml' is not UTF-8 text (byte offset 37); convert it to UTF-8"),
        (lambda p: p.write_bytes(b"# " + b"x" * (1 << 20) + b"\n"), "r.yaml' is larger than 1 MB"),
        (lambda p: p.write_text("[" * 5000 + "]" * 5000), "r.yaml' nests too deeply to be a recipe"),
    ],
)
def test_unusable_recipe_files(tmp_path, make, message):
    make(tmp_path / "r.yaml")
    with pytest.raises(PtqError) as error:
        load_recipe(tmp_path / "r.yaml")
    assert message in str(error.value) and "\n" not in str(error.value)


def test_unreadable_recipe_file(tmp_path, monkeypatch):
    recipe = write(tmp_path / "r.yaml", "steps: [{rtn: {scheme: W4A16}}]\n")

    def refuse(self):  # as chmod 0 does for anyone but root
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(PtqError, match="cannot read recipe '.*r.yaml': Permission denied$"):
        load_recipe(recipe)


@pytest.mark.parametrize("value", [123, None, ["W4A16"], b"W4A16"])
def test_recipe_values_that_are_no_recipe(value):
    with pytest.raises(PtqError, match=f"a recipe is a Recipe, a YAML file path or a preset name .*, not {type(value).__name__}"):
        load_recipe(value)


def test_unknown_preset_names_the_presets():
    with pytest.raises(PtqError, match="recipe file 'W5A16' not found; pass a YAML file .* or a preset name \\(W4A16, "):
        load_recipe("W5A16")
