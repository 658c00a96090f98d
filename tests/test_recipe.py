"""Recipes: every bundled recipe loads; bad ones are rejected with one line naming the problem."""

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
        ({"steps": []}, "steps: List should have at least 1 item"),
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
