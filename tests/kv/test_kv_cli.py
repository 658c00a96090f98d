"""`ptq quantize` with kv_cache recipes: bad input is one line, exit 2, nothing written; the
KV rows of the summary."""

import json

import pytest

from ptq.cli import main
from tests.conftest import tiny_model


def run(tmp_path, capsys, recipe: str, *extra):
    path = tmp_path / "r.yaml"
    path.write_text(recipe)
    code = main(["quantize", "--recipe", str(path), "--output", str(tmp_path / "out"), *extra])
    return code, capsys.readouterr()


@pytest.mark.parametrize("recipe,message", [
    ("kv_cache: {scheme: INT4, strategy: blocks}", "kv_cache.strategy: Input should be 'tensor', 'head' or 'kivi'"),
    ("kv_cache: {scheme: INT4, strategy: kivi, group_size: 24, residual: 48}",
     "kv_cache group_size 24 does not divide the model's head_dim 32; choose a divisor of it"),
    ("kv_cache: {scheme: INT2, strategy: kivi, group_size: 32, residual: 16}",
     "kv_cache: residual 16 is smaller than group_size 32"),
    ("kv_cache: {scheme: INT4, strategy: head}", "kv_cache: scheme INT4 is quantized per group as tokens arrive"),
    ("kv_cache: {scheme: FP8, strategy: tensor, residual: 64}", "kv_cache: residual is a kivi option"),
])
def test_bad_kv_recipes(tmp_path, capsys, recipe, message):
    code, out = run(tmp_path, capsys, recipe, "--no-eval")
    assert code == 2
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family,message", [
    ("mistral", "the model's attention uses a sliding window of 4096 tokens"),
    ("gemma2", "layer 0 uses sliding_attention"),
])
def test_models_whose_attention_the_cache_cannot_serve(tmp_path, capsys, tokenizer, family, message):
    folder = tmp_path / family
    tiny_model(family).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    code, out = run(tmp_path, capsys, "kv_cache: {scheme: INT4, strategy: kivi}", "--model", str(folder), "--no-eval")
    assert code == 2 and len(out.err.strip().splitlines()) == 1 and message in out.err, out.err
    assert not (tmp_path / "out").exists()


def test_summary_has_kv_rows(tmp_path, capsys):
    report = tmp_path / "report.json"
    code, out = run(tmp_path, capsys, "kv_cache: {scheme: INT4, strategy: kivi}", "--model", "builtin-2k",
                    "--kv-eval-windows", "2", "--report-json", str(report))
    assert code == 0, out.err
    for row in ("KV KL (nats/token), positions 1K-2K", "KV cache bytes per token", "tokens of KV cache in 1 GiB"):
        assert row in out.out
    data = json.loads(report.read_text())["kv_cache"]
    assert data["seq_len"] == 2048 and data["dense_bytes_per_token"] == 1024
    assert 0.3 < data["memory_ratio"] < 0.45  # int4 + scales + the 128-token window, at 2048 tokens
    assert (tmp_path / "out" / "kv_cache.json").is_file()
    code = main(["eval", str(tmp_path / "out"), "--kv-eval-windows", "1", "--eval-windows", "2"])
    assert code == 0 and "KV perplexity, positions 1K-2K" in capsys.readouterr().out


@pytest.mark.parametrize("budget", ["-3", "0", "nan", "lots"])
def test_kv_budget_must_be_a_positive_number(tmp_path, capsys, budget):
    code, out = run(tmp_path, capsys, "kv_cache: {scheme: INT4, strategy: kivi}", "--kv-budget-gb", budget)
    assert code == 2 and len(out.err.strip().splitlines()) == 1 and "--kv-budget-gb" in out.err
    assert not (tmp_path / "out").exists()
