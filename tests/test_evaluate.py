"""Evaluation: perplexity is exp(mean NLL); a model against itself has KL 0 and full agreement."""

import math

import pytest
import torch

from ptq.errors import PtqError
from ptq.evaluate import eval_windows, evaluate, reference_logits
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_logits_on_disk_give_the_same_numbers(tokenizer, tmp_path, dtype):
    """The reference's logits kept on disk (the CLI's way, one model in memory) against the
    reference model itself: bit-exact EvalResult; other windows or batches are refused."""
    model = tiny_model("llama", seed=0, dtype=dtype)
    other = tiny_model("llama", seed=1, dtype=dtype)
    windows = eval_windows(tokenizer, seq_len=64, max_windows=5)
    stored = reference_logits(other, windows, tmp_path / "logits", batch_size=2, show_progress=False)
    assert len(list((tmp_path / "logits").iterdir())) == 3  # one file per batch
    from_disk = evaluate(model, windows, reference=stored, batch_size=2, show_progress=False)
    assert from_disk == evaluate(model, windows, reference=other, batch_size=2, show_progress=False)
    with pytest.raises(PtqError, match="other windows or batches"):
        evaluate(model, windows, reference=stored, batch_size=4, show_progress=False)
    with pytest.raises(PtqError, match="other windows or batches"):
        evaluate(model, windows[:4], reference=stored, batch_size=2, show_progress=False)
    stored.remove()
    assert not (tmp_path / "logits").exists()
