"""Streaming a model folder (ptq.streaming): the checkpoint is the in-memory path's, tensor by tensor."""

from __future__ import annotations

import copy
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


def test_cli_stream_evaluates_as_the_in_memory_path(tmp_path, capsys):
    """--stream with evaluation: the original's logits streamed from the source folder, the
    quantized model's from the checkpoint just written; the very numbers of the in-memory run."""
    from ptq.cli import main

    common = ["quantize", "--recipe", "recipes/w4a16-rtn.yaml", "--eval-windows", "6", "--eval-seq-len", "128"]
    for how in ("memory", "streamed"):
        extra = ["--stream"] if how == "streamed" else []
        assert main([*common, *extra, "--output", tmp_path / how, "--report-json", tmp_path / f"{how}.json"]) == 0
    assert "KL to original" in capsys.readouterr().out
    memory, streamed = (json.loads((tmp_path / f"{how}.json").read_text())["quality"] for how in ("memory", "streamed"))
    assert memory["kl"] > 0 and memory["tokens"] == 6 * 127
    assert streamed == memory  # bit-exact: the same logits, summed in the same order
    _assert_same_checkpoint(tmp_path / "memory", tmp_path / "streamed")
    assert not any((tmp_path / "streamed").glob(".shard-*"))  # no part file left behind


@pytest.mark.parametrize("family", ["llama", "llama3"])  # llama3: lm_head tied to the embeddings
def test_streamed_logits_are_the_models_bit_for_bit(family, tokenizer, tmp_path):
    """streamed_logits, one block in memory, against the model's own forward pass: the
    original (read from its folder) and the quantized one (read from the checkpoint written)."""
    from ptq.devices import compute_dtype_for
    from ptq.pipeline import cast_parameters_
    from ptq.streaming import meta_model, streamed_logits

    source = tmp_path / "source"
    tiny_model(family).save_pretrained(source, max_shard_size="300KB")
    tokenizer.save_pretrained(source)
    windows = ptq.eval_windows(tokenizer, seq_len=64, max_windows=5)
    model, _ = ptq.load_model(source)
    dtype = compute_dtype_for("cpu", next(model.parameters()).dtype)
    reference = copy.deepcopy(model)  # in the compute dtype; the model stays bf16 for quantize, which casts
    cast_parameters_(reference, dtype)  # it itself after reading its dtype (the checkpoint's: bf16 scales)
    original = meta_model(source)
    cast_parameters_(original, dtype)
    with torch.no_grad():
        before = [reference(input_ids=batch, use_cache=False).logits for batch in windows.split(2)]
        recipe = _recipe("recipes/w4a16-rtn.yaml", tmp_path)
        ptq.quantize(model, recipe, show_progress=False)  # the in-memory path's quantized model
        after = [model(input_ids=batch, use_cache=False).logits for batch in windows.split(2)]
    (tmp_path / "out").mkdir()
    quantized, shards = quantize_streamed(source, recipe, tmp_path / "out", show_progress=False)
    write_checkpoint(quantized, tmp_path / "out", shards=shards)
    for folder, meta, expected in ((source, original, before), (tmp_path / "out", quantized, after)):
        got = list(streamed_logits(meta, folder, windows, batch_size=2))
        assert len(got) == len(expected) == 3
        assert all(torch.equal(g, e) for g, e in zip(got, expected))
        assert all(t.is_meta for t in meta.parameters()), "streamed_logits leaves no weight loaded"


def test_streaming_refuses_nan_weights_as_it_loads_them(tokenizer, tmp_path):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "source")
    (tmp_path / "out").mkdir()
    with pytest.raises(PtqError, match="'model.layers.1.mlp.up_proj.weight' contains NaN"):
        quantize_streamed(tmp_path / "source", "recipes/w4a16-rtn.yaml", tmp_path / "out", show_progress=False)
