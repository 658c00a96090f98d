"""Quality floors on the bundled model, measured on fixed seeds (numbers in the comments).

Perplexity increases are over the unquantized model on 64 held-out windows of 512 tokens.
"""

import json

import pytest
import torch

import ptq
from ptq.devices import compute_dtype_for
from ptq.diagnostics import inject_outliers_
from ptq.evaluate import ReferenceLogits, reference_logits
from ptq.models import bundled_model_path
from ptq.pipeline import cast_parameters_
from ptq.recipe import parse_recipe

CALIBRATION = {"samples": 128, "seq_len": 512, "seed": 0}


@pytest.fixture(scope="module")
def windows(tokenizer):
    return ptq.eval_windows(tokenizer, seq_len=512, max_windows=64)


_QUALITY: dict[str, tuple[float, float]] = {}  # the runs so far (deterministic): several tests share some
_REFERENCES: dict[str, ReferenceLogits] = {}  # the unquantized model's logits, per variant and dtype
_FOLDER = []  # where they are kept while this module's tests run


@pytest.fixture(scope="module", autouse=True)
def _reference_folder(tmp_path_factory):
    """The reference logits are computed once per model variant and dtype (ptq.evaluate reads
    them back as the very numbers the model gives) and deleted after this module's tests."""
    _FOLDER.append(tmp_path_factory.mktemp("reference-logits"))
    yield
    for logits in _REFERENCES.values():
        logits.remove()
    _REFERENCES.clear()
    _FOLDER.clear()


def quality(recipe: dict, windows, tokenizer, outliers: bool = False, dtype=None) -> tuple[float, float]:
    """(perplexity after minus before, KL) of the recipe on the bundled model (or its
    outlier variant), both models computed in the dtype ptq chose (or was given). A run
    made before with the same arguments (the dtype as ptq resolves it: on a CPU without
    fast bf16, None is float32) is not made again: a quantization gives the same bits
    every time (tests/test_devices.py), and on a slow CPU each takes tens of seconds."""
    resolved = dtype or compute_dtype_for("cpu", torch.bfloat16)
    key = json.dumps([recipe, outliers, str(resolved), len(windows)], sort_keys=True)
    if key not in _QUALITY:
        _QUALITY[key] = _quality(recipe, windows, tokenizer, outliers, dtype)
    return _QUALITY[key]


def _model(outliers: bool):
    model, _ = ptq.load_model()
    if outliers:
        model.float()
        inject_outliers_(model, channels=4, factor=50.0, seed=0)
        model.to(torch.bfloat16)
    return model


def _quality(recipe: dict, windows, tokenizer, outliers: bool, dtype) -> tuple[float, float]:
    quantized = _model(outliers)
    ptq.quantize(quantized, parse_recipe(recipe), tokenizer=tokenizer, dtype=dtype, show_progress=False)
    computed = quantized.ptq_report.compute_dtype
    key = json.dumps([outliers, str(computed), len(windows)])
    if key not in _REFERENCES:
        reference = _model(outliers)
        cast_parameters_(reference, computed)
        _REFERENCES[key] = reference_logits(reference, windows, _FOLDER[0] / str(len(_REFERENCES)),
                                            show_progress=False)
    result = ptq.evaluate(quantized, windows, reference=_REFERENCES[key], show_progress=False)
    return result.perplexity - result.reference_perplexity, result.kl


def increase(recipe: dict, windows, tokenizer, outliers: bool = False) -> float:
    return quality(recipe, windows, tokenizer, outliers)[0]


def test_bundled_model_learned_the_language(tokenizer, windows):
    report = json.loads((bundled_model_path() / "training_report.json").read_text())
    model, _ = ptq.load_model()
    config = model.config
    assert config.num_hidden_layers >= 4 and config.num_key_value_heads < config.num_attention_heads
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.in_features % 128 == 0 for m in linears)
    assert (bundled_model_path() / "model.safetensors").stat().st_size <= 25e6
    assert model.dtype == torch.bfloat16
    perplexity = ptq.evaluate(model.float(), windows, show_progress=False).perplexity
    # measured: 79.8 here, against 861 for the unigram model of the same tokenizer
    assert perplexity < 100 < report["unigram_perplexity"] / 8


# measured (perplexity increase, KL), 128 x 512 calibration tokens, RTN (min-max) -> GPTQ
# (default: mse observer) [GPTQ with the min-max observer]:
#   W4 float32: +0.608, 0.0130 -> +0.042, 0.00513 [+0.282, 0.00574]
#   W4 bf16:    +0.616, 0.0132 -> +0.003, 0.00528 [+0.323, 0.00592]
#   W3 bf16:    +2.122, 0.0601 -> +0.517, 0.0209  [+1.051, 0.0268]
# A perplexity increase this small is within the noise of 64 windows (it can come out
# below zero), so the floors are on KL as well, which is steady.
@pytest.mark.parametrize("scheme,dtype,floor", [("W4A16", torch.float32, 0.3), ("W4A16", None, 0.3),
                                                 ("W3A16", None, 0.5)])
def test_gptq_beats_rtn(tokenizer, windows, scheme, dtype, floor):
    rtn, rtn_kl = quality({"steps": [{"rtn": {"scheme": scheme}}]}, windows, tokenizer, dtype=dtype)
    gptq, gptq_kl = quality({"calibration": CALIBRATION, "steps": [{"gptq": {"scheme": scheme}}]}, windows,
                            tokenizer, dtype=dtype)
    assert gptq <= floor * rtn
    assert gptq_kl <= 0.5 * rtn_kl


def test_mse_observer_beats_minmax_for_gptq(tokenizer, windows):
    """The default observer was chosen on these numbers (W3: KL 0.0209 against 0.0268).

    Measured since the Hessian's GEMMs and the factorisation were reblocked (issue 15; the
    same bits on any thread count, slightly different ones from before): W3 +0.694 against
    +0.984 (0.71x; it was 0.61 against 0.96), KL 0.0211 against 0.0268. The perplexity
    increase moves by that much with the rounding of H alone; the KL does not."""
    mse = quality({"calibration": CALIBRATION, "steps": [{"gptq": {"scheme": "W3A16"}}]}, windows, tokenizer)
    minmax = quality({"calibration": CALIBRATION, "steps": [{"gptq": {"scheme": "W3A16", "observer": "minmax"}}]},
                     windows, tokenizer)
    assert mse[0] <= 0.8 * minmax[0]
    assert mse[1] <= 0.85 * minmax[1]


def test_awq_beats_rtn_with_outliers(tokenizer, windows):
    rtn = increase({"steps": [{"rtn": {"scheme": "W4A16"}}]}, windows, tokenizer, outliers=True)
    awq = increase({"calibration": {**CALIBRATION, "samples": 32}, "steps": [{"awq": {}}, {"rtn": {"scheme": "W4A16"}}]},
                   windows, tokenizer, outliers=True)
    # measured on 32 windows: +0.546 vs +1.217 (0.45)
    assert awq <= 0.7 * rtn


def test_awq_linear_loss_beats_rtn_with_outliers(tokenizer, windows):
    """loss: linear (each balance Linear's own output error, from Gram matrices) against the
    default module loss, measured on 64 windows with outliers: +0.503 against +0.632 (RTN
    +1.357); without outliers +0.497 against +0.621, KL 0.0132 against 0.0128 (RTN 0.0132)."""
    rtn = increase({"steps": [{"rtn": {"scheme": "W4A16"}}]}, windows, tokenizer, outliers=True)
    recipe = {"calibration": {**CALIBRATION, "samples": 32}, "steps": [{"awq": {"loss": "linear"}},
                                                                     {"rtn": {"scheme": "W4A16"}}]}
    assert increase(recipe, windows, tokenizer, outliers=True) <= 0.5 * rtn


def test_smoothquant_rescues_w8a8_with_outliers(tokenizer, windows):
    plain = increase({"steps": [{"rtn": {"scheme": "W8A8"}}]}, windows, tokenizer, outliers=True)
    smooth = increase({"calibration": {**CALIBRATION, "samples": 32},
                       "steps": [{"smoothquant": {"alpha": 0.5}}, {"rtn": {"scheme": "W8A8"}}]},
                      windows, tokenizer, outliers=True)
    # measured on 32 windows: +0.009 vs +1.913
    assert smooth <= 0.2 * plain
