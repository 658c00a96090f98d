"""The model card (README.md) in every checkpoint: its front matter as huggingface_hub reads
it, and numbers that are the run's own (the CLI's JSON report)."""

import json
import shutil

import pytest
from huggingface_hub import ModelCard

import ptq
from ptq.cli import main
from ptq.export.card import CardFacts, model_card, scheme_name
from ptq.kv.evaluate import KVBucket, KVEvalResult
from ptq.modules import QuantLinear
from ptq.schemes import PRESETS, QuantArgs, Scheme
from tests.conftest import tiny_model


def table_rows(text: str) -> dict[str, list[str]]:
    """Every markdown table row of the card: first cell -> the other cells."""
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] and not set(cells[0]) <= set("-:"):
            rows[cells[0]] = cells[1:]
    return rows


def byte_count(cell: str) -> int:
    return int(cell.split(" bytes")[0].replace(",", ""))


def test_the_cli_card_holds_the_runs_numbers(tmp_path, capsys):
    out, report = tmp_path / "tiny-w4a16-rtn", tmp_path / "report.json"
    code = main(["quantize", "--recipe", "recipes/w4a16-rtn.yaml", "--output", out, "--eval-windows", "2",
                 "--report-json", report])
    assert code == 0, capsys.readouterr().err
    numbers = json.loads(report.read_text())
    card = ModelCard.load(out / "README.md")
    assert card.data.to_dict() == {
        "base_model": "ptq-tiny-llama", "base_model_relation": "quantized", "library_name": "transformers",
        "pipeline_tag": "text-generation", "tags": ["ptq", "compressed-tensors", "w4a16", "rtn"],
    }
    rows = table_rows(card.text)
    quality, size, bits = numbers["quality"], numbers["size_bytes"], numbers["bits_per_weight"]
    assert rows["perplexity"] == [f"{quality['reference_perplexity']:.3f}", f"{quality['perplexity']:.3f}"]
    assert rows["KL to original (nats/token)"] == ["0", f"{quality['kl']:.5f}"]
    assert rows["top-1 agreement with original"] == ["100%", f"{100 * quality['top1']:.2f}%"]
    assert [byte_count(c) for c in rows["model size"]] == [size["before"], size["after"]]
    assert rows["bits per weight (Linears, incl. scales)"] == [f"{bits['before']:.2f}", f"{bits['after']:.2f}"]
    assert f"{quality['tokens']:,} predicted tokens in 2 windows of 512 tokens" in card.text
    assert rows["parameters quantized"] == [f"{numbers['share_quantized']:.1%}"]
    assert rows["weights"] == ["int4, symmetric, one scale per group of 128 inputs, static"]
    assert f"```yaml\n{(out / 'recipe.yaml').read_text()}```" in card.text  # the recipe, verbatim
    assert 'model_id = "tiny-w4a16-rtn"' in card.text and 'LLM(model="tiny-w4a16-rtn")' in card.text
    assert "None: this recipe needs no calibration data." in card.text
    assert "README.md" in json.loads((out / "ptq.json").read_text())["files"]


@pytest.fixture(scope="module")
def quantized(tokenizer):
    return ptq.quantize(tiny_model(), "W8A16", tokenizer=tokenizer, show_progress=False)


def test_a_library_save_without_evaluation(tmp_path, user_model_dir, tokenizer):
    source = shutil.copytree(user_model_dir, tmp_path / "my-llama")
    (source / "README.md").write_text("---\nlicense: other\nlicense_name: tiny\nlicense_link: LICENSE\n---\n# mine\n")
    model, _ = ptq.load_model(source)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("calibration: {samples: 4, seq_len: 16, seed: 7}\nsteps:\n  - gptq: {scheme: W8A16}\n")
    ptq.quantize(model, recipe, tokenizer=tokenizer, data=["A short text to calibrate on."] * 4, show_progress=False)
    ptq.save(model, tmp_path / "out", tokenizer=tokenizer)
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.base_model == "my-llama"  # the source folder's name
    assert (card.data.license, card.data.license_name, card.data.license_link) == ("other", "tiny", "LICENSE")
    assert card.data.tags == ["ptq", "compressed-tensors", "w8a16", "gptq"]
    assert "## Evaluation" not in card.text and "perplexity" not in card.text
    rows = table_rows(card.text)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]  # int8 weights, a bf16 scale per row
    bits = sum(m.out_features * (8 * m.in_features + 16) for m in linears) / sum(m.weight_shape.prod() for m in linears)
    assert rows["bits per weight (Linears, incl. scales)"] == [f"{bits:.2f}"]
    assert rows["source"] == ["a list of 4 items given to ptq.quantize"]  # not the recipe's own source
    assert rows["samples"] == ["4"] and rows["seq_len"] == ["16"] and rows["seed"] == ["7"]


@pytest.mark.parametrize("readme", [
    "---\nlicense: [not, a, string]\n---\n", "---\n- a list\n---\n", "---\n{unclosed\n---\n", "no front matter",
    b"\xff\xfe\x00binary",
])
def test_a_source_readme_without_a_usable_license_is_ignored(tmp_path, user_model_dir, quantized, readme):
    source = shutil.copytree(user_model_dir, tmp_path / "src")
    (source / "README.md").write_bytes(readme.encode() if isinstance(readme, str) else readme)
    quantized.config._name_or_path = str(source)
    try:
        card = model_card(quantized, CardFacts())
    finally:
        quantized.config._name_or_path = ""
    assert card.data.license is None and card.data.base_model == "src"


def test_the_same_model_writes_the_same_card(tmp_path, quantized):
    for run in "ab":  # the same folder name (it is in the card), in two places
        (tmp_path / run).mkdir()
        ptq.save(quantized, tmp_path / run / "q")
    assert (tmp_path / "a" / "q" / "README.md").read_bytes() == (tmp_path / "b" / "q" / "README.md").read_bytes()
    card = ModelCard.load(tmp_path / "a" / "q" / "README.md")
    assert card.data.base_model is None  # a model built from a config has no source to name


def test_a_kv_cache_run_has_its_rows_and_tag(tokenizer):
    model = ptq.quantize(tiny_model(), "recipes/kv-int4.yaml", tokenizer=tokenizer, show_progress=False)
    kv = KVEvalResult("INT4 kivi", 512, 32, 2, [KVBucket("0-256", 0, 256, 512, 80.5, 80.0, 0.00123, 0.97)],
                      bytes_per_token=364.0, dense_bytes_per_token=1024)
    card = model_card(model, CardFacts(name="kv", kv_quality=kv, kv_budget_gb=1.0))
    assert card.data.tags == ["ptq", "kv-cache-int4"]  # no compressed-tensors form: kv_cache.json
    assert "### KV cache" in card.text and "## Calibration data\n\nNone" in card.text
    rows = table_rows(card.text)
    assert rows["KV perplexity, positions 0-256"] == ["80.000", "80.500"]
    assert rows["KV KL (nats/token), positions 0-256"] == ["0", "0.00123"]
    assert rows["KV cache size vs 16-bit"] == ["1.00x", "0.355x"]
    assert rows["KV cache"] == ["INT4 kivi (keys per channel, group 32, 128-token 16-bit window)"]


def test_scheme_names():
    assert {name: scheme_name(scheme) for name, scheme in PRESETS.items()} == {
        "W4A16": "w4a16", "W4A16_ASYM": "w4a16-asym", "W3A16": "w3a16", "W8A16": "w8a16", "W8A8": "w8a8",
        "FP8": "fp8", "FP8_DYNAMIC": "fp8-dynamic",
    }
    assert scheme_name(Scheme(weights=QuantArgs(num_bits=2, group_size=64, symmetric=False))) == "w2a16-asym"
