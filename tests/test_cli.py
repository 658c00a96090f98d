"""The CLI: bad input gets one line on stderr, exit code 2, and no output folder."""

import subprocess
import sys

import pytest
import torch

from ptq.cli import main
from tests.conftest import tiny_model


@pytest.fixture
def small_model(user_model_dir):
    return user_model_dir


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_user_error(capsys, argv, message, output):
    code, _out, err = run_cli(capsys, *argv)
    assert code == 2
    assert "Traceback" not in err
    # progress bars (tqdm's "it/s]" lines) may come first; the error itself is one line
    lines = [line for line in err.strip().splitlines() if line.strip() and "it/s]" not in line]
    assert len(lines) == 1 and lines[0].startswith("ptq: error: "), err
    assert message in lines[0]
    assert not output.exists()


def write(path, text):
    path.write_text(text)
    return path


GPTQ_RECIPE = "calibration: {samples: 2, seq_len: 64}\nsteps:\n  - gptq: {scheme: W4A16}\n"


def test_missing_model_path(capsys, tmp_path):
    out = tmp_path / "out"
    assert_user_error(capsys, ["quantize", "--recipe", "W4A16", "--model", tmp_path / "nope", "--output", out],
                      "does not exist", out)


def test_unreadable_model_path(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert_user_error(capsys, ["quantize", "--recipe", "W4A16", "--model", tmp_path / "empty", "--output", out],
                      "is not a model folder", out)


def test_broken_model_files(capsys, tmp_path):
    (tmp_path / "model").mkdir()
    write(tmp_path / "model" / "config.json", "{not json")
    out = tmp_path / "out"
    assert_user_error(capsys, ["quantize", "--recipe", "W4A16", "--model", tmp_path / "model", "--output", out],
                      "cannot load model", out)


@pytest.mark.parametrize(
    "recipe,message",
    [
        (None, "not found"),
        ("steps: [rtn: {scheme: W4A16}\n", "is not valid YAML"),
        ("steps:\n  - rtn: {scheme: W4A16, groupsize: 64}\n", "unknown key 'groupsize'"),
        ("steps:\n  - rtn: {scheme: W4A16, targets: Linear}\n", "targets: Input should be a valid list"),
        ("steps:\n  - rtn: {scheme: {weights: {num_bits: 0, strategy: channel}}}\n", "num_bits"),
        ("steps:\n  - rtn: {scheme: {weights: {num_bits: 9, strategy: channel}}}\n", "less than or equal to 8 (got 9)"),
    ],
)
def test_bad_recipes(capsys, tmp_path, small_model, recipe, message):
    path = tmp_path / "r.yaml"
    if recipe is not None:
        write(path, recipe)
    out = tmp_path / "out"
    assert_user_error(capsys, ["quantize", "--recipe", path, "--model", small_model, "--output", out], message, out)


def test_group_size_must_divide_in_features(capsys, tmp_path, small_model):
    recipe = write(tmp_path / "r.yaml", "steps:\n  - rtn: {scheme: {weights: {num_bits: 4, group_size: 96}}}\n")
    out = tmp_path / "out"
    assert_user_error(capsys, ["quantize", "--recipe", recipe, "--model", small_model, "--output", out],
                      "group_size 96 does not divide in_features 128 of layer 'model.layers.0.self_attn.q_proj'", out)


def test_output_exists(capsys, tmp_path, small_model):
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = run_cli(capsys, "quantize", "--recipe", "W4A16", "--model", small_model, "--output", out)
    assert code == 2 and "already exists" in err and list(out.iterdir()) == []


def test_calibration_text_too_short(capsys, tmp_path, small_model):
    recipe = write(tmp_path / "r.yaml", GPTQ_RECIPE)
    data = write(tmp_path / "short.txt", "Too short to fill one sample.\n")
    out = tmp_path / "out"
    assert_user_error(capsys, ["quantize", "--recipe", recipe, "--model", small_model, "--data", data,
                               "--output", out], "fewer than one sample of seq_len=64", out)


def test_nan_weights(capsys, tmp_path, tokenizer):
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    model.save_pretrained(tmp_path / "nan")
    tokenizer.save_pretrained(tmp_path / "nan")
    out = tmp_path / "out"
    assert_user_error(capsys, ["quantize", "--recipe", "W4A16", "--model", tmp_path / "nan", "--output", out],
                      "'model.layers.1.mlp.up_proj.weight' contains NaN or Inf", out)


def test_quantize_and_eval(capsys, tmp_path, small_model):
    out = tmp_path / "out"
    code, stdout, _ = run_cli(capsys, "quantize", "--recipe", "W8A16", "--model", small_model, "--output", out,
                              "--eval-windows", "2", "--eval-seq-len", "64")
    assert code == 0 and (out / "config.json").exists() and (out / "tokenizer.json").exists()
    for row in ("model size", "bits per weight", "perplexity", "KL to original", "wall time", "peak memory"):
        assert row in stdout
    code, stdout, _ = run_cli(capsys, "eval", out, "--reference", small_model, "--eval-windows", "2",
                              "--eval-seq-len", "64")
    assert code == 0 and "perplexity:" in stdout and "KL to reference:" in stdout


def test_python_dash_m(tmp_path):
    result = subprocess.run([sys.executable, "-m", "ptq", "quantize", "--recipe", tmp_path / "missing.yaml"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"ptq: error: recipe file '{tmp_path / 'missing.yaml'}' not found; "
                                                  "pass a YAML file (see recipes/) or a preset name (W4A16, W4A16_ASYM, W3A16, W8A16, W8A8, "
                                                  "FP8, FP8_DYNAMIC)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_bench_without_gpu(capsys):
    code, _, err = run_cli(capsys, "bench")
    assert code == 2 and err.strip() == "ptq: error: no CUDA GPU here: ptq bench measures the Triton kernels on a GPU"


def test_never_writes_into_the_source_model(capsys, tmp_path, small_model):
    before = sorted(p.name for p in small_model.iterdir())
    for output in (small_model, small_model / "quantized"):
        code, _, err = run_cli(capsys, "quantize", "--recipe", "W4A16", "--model", small_model,
                               "--output", output, "--overwrite")
        assert code == 2 and "is the source model's folder" in err
    assert sorted(p.name for p in small_model.iterdir()) == before
