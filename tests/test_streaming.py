"""Streaming a model folder (ptq.streaming): the checkpoint is the in-memory path's, tensor by tensor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ptq
from ptq.checkpoint.writer import write_checkpoint
from ptq.errors import PtqError
from ptq.recipe import load_recipe
from ptq.safetensors_check import weight_files
from ptq.streaming import quantize_streamed
from tests.conftest import tiny_model

FEW_SAMPLES = {"samples": 4, "seq_len": 64}  # calibration kept small: the comparison is bit-exact either way


def _recipe(path_or_text: str, tmp_path: Path):
    if path_or_text.endswith(".yaml"):
        recipe = load_recipe(path_or_text)
    else:
        (tmp_path / "recipe.yaml").write_text(path_or_text)
        recipe = load_recipe(tmp_path / "recipe.yaml")
    return recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update=FEW_SAMPLES)})


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in weight_files(folder):
        with safe_open(path, framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _both_ways(source: Path, recipe, tokenizer, out: Path, max_shard_bytes: int) -> tuple[Path, Path]:
    """The checkpoint of the in-memory path and of the streamed one."""
    model, _ = ptq.load_model(source)
    ptq.quantize(model, recipe, tokenizer=tokenizer, show_progress=False)
    (out / "memory").mkdir()
    write_checkpoint(model, out / "memory", tokenizer=tokenizer)
    (out / "streamed").mkdir()
    streamed, shards = quantize_streamed(source, recipe, out / "streamed", tokenizer=tokenizer, show_progress=False,
                                         max_shard_bytes=max_shard_bytes)
    assert all(t.is_meta for t in streamed.parameters()), "a streamed model ends with no weight in memory"
    write_checkpoint(streamed, out / "streamed", tokenizer=tokenizer, shards=shards)
    assert streamed.ptq_report.layers == model.ptq_report.layers
    return out / "memory", out / "streamed"


def _assert_same_checkpoint(memory: Path, streamed: Path) -> None:
    expected, got = _tensors(memory), _tensors(streamed)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    for file in ("config.json", "generation_config.json"):
        assert json.loads((streamed / file).read_text()) == json.loads((memory / file).read_text()), file


@pytest.mark.parametrize("recipe", ["recipes/w4a16-rtn.yaml", "recipes/w4a16-gptq.yaml",
                                    "recipes/w8a8-int8-smoothquant-gptq.yaml"])
def test_bundled_model_streamed_equals_in_memory(recipe, bundled_path, tokenizer, tmp_path):
    # a small shard size: the streamed output is split over several shards and an index
    memory, streamed = _both_ways(bundled_path, _recipe(recipe, tmp_path), tokenizer, tmp_path, 2 * 1024**2)
    assert (streamed / "model.safetensors.index.json").is_file()
    _assert_same_checkpoint(memory, streamed)


# lm_head quantized too (RTN outside the blocks); tied to the embeddings in llama3
RECIPE_ALL = "steps:\n  - {step}: {{scheme: W4A16, targets: [Linear]}}\n"
CALIBRATION = "calibration: {dataset: builtin, samples: 4, seq_len: 64}\n"


@pytest.mark.parametrize("family", ["llama", "llama3"])
@pytest.mark.parametrize("step", ["rtn", "gptq"])
def test_random_llama_streamed_from_shards_equals_in_memory(family, step, tokenizer, tmp_path):
    source = tmp_path / "source"
    tiny_model(family).save_pretrained(source, max_shard_size="300KB")  # several input shards
    tokenizer.save_pretrained(source)
    assert len(weight_files(source)) > 1
    recipe = _recipe((CALIBRATION if step == "gptq" else "") + RECIPE_ALL.format(step=step), tmp_path)
    memory, streamed = _both_ways(source, recipe, tokenizer, tmp_path, 256 * 1024**2)
    assert (streamed / "model.safetensors").is_file()  # one shard, as the in-memory path writes
    _assert_same_checkpoint(memory, streamed)


def test_streaming_refuses_a_kv_cache_recipe(bundled_path, tmp_path):
    with pytest.raises(PtqError, match="kv_cache"):
        quantize_streamed(bundled_path, "recipes/fp8-kv.yaml", tmp_path)


def test_streaming_names_a_missing_tensor(tokenizer, tmp_path):
    source = tmp_path / "source"
    tiny_model("llama").save_pretrained(source)
    tokenizer.save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    (tmp_path / "out").mkdir()
    with pytest.raises(PtqError, match="model.layers.2.* is not in the model's safetensors files"):
        quantize_streamed(source, "recipes/w4a16-rtn.yaml", tmp_path / "out", show_progress=False)


def test_cli_stream_writes_the_in_memory_checkpoint(tmp_path, capsys):
    from ptq.cli import main

    common = ["quantize", "--recipe", "recipes/w4a16-rtn.yaml", "--no-eval"]
    assert main([*common, "--output", tmp_path / "memory"]) == 0
    assert main([*common, "--stream", "--output", tmp_path / "streamed"]) == 0
    assert "wrote" in capsys.readouterr().out
    _assert_same_checkpoint(tmp_path / "memory", tmp_path / "streamed")


def test_cli_stream_asks_for_no_eval(tmp_path, capsys):
    from ptq.cli import main

    assert main(["quantize", "--recipe", "recipes/w4a16-rtn.yaml", "--stream", "--output", tmp_path / "o"]) == 2
    assert "--stream does not evaluate yet" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_streaming_refuses_nan_weights_as_it_loads_them(tokenizer, tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "source")
    (tmp_path / "out").mkdir()
    with pytest.raises(PtqError, match="'model.layers.1.mlp.up_proj.weight' contains NaN"):
        quantize_streamed(tmp_path / "source", "recipes/w4a16-rtn.yaml", tmp_path / "out", show_progress=False)
