"""Evaluation: perplexity is exp(mean NLL); a model against itself has KL 0 and full agreement."""

import math

import pytest
import torch

from ptq.errors import PtqError
from ptq.evaluate import eval_windows, evaluate
from tests.conftest import tiny_model


def test_windows_are_disjoint_slices(tokenizer):
    windows = eval_windows(tokenizer, seq_len=128, max_windows=3)
    assert windows.shape == (3, 128)
    assert windows[0, 0].item() == tokenizer.bos_token_id
    with pytest.raises(PtqError, match="fewer than one window"):
        eval_windows(tokenizer, ["short"], seq_len=128)


def test_perplexity_matches_model_loss(tokenizer):
    model = tiny_model("llama", dtype=torch.float32)
    windows = eval_windows(tokenizer, seq_len=64, max_windows=4)
    result = evaluate(model, windows, batch_size=3, show_progress=False)
    with torch.no_grad():
        loss = model(input_ids=windows, labels=windows).loss.item()  # mean over all predicted tokens
    assert result.tokens == 4 * 63
    assert math.isclose(result.perplexity, math.exp(loss), rel_tol=1e-4)
    assert result.kl is None and result.top1 is None


def test_against_itself_and_another(tokenizer):
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    other = tiny_model("llama", seed=1, dtype=torch.float32)
    windows = eval_windows(tokenizer, seq_len=64, max_windows=2)
    same = evaluate(model, windows, reference=model, show_progress=False)
    assert same.kl == pytest.approx(0.0, abs=1e-6) and same.top1 == 1.0
    assert same.reference_perplexity == pytest.approx(same.perplexity)
    different = evaluate(model, windows, reference=other, show_progress=False)
    assert different.kl > 1e-3 and different.top1 < 1.0
