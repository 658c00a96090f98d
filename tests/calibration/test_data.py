"""Calibration data from every supported source, tokenized into seeded windows."""

import json

import pytest
import torch

from ptq.calibration.data import calibration_batches, load_texts, sample_windows, token_stream
from ptq.errors import PtqError


def test_builtin_parts_do_not_overlap():
    calib, held_out = load_texts("builtin"), load_texts("builtin-eval")
    assert len(calib) > 5000 and len(held_out) > 500
    assert not set(calib) & set(held_out)


def test_text_and_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("First paragraph.\n\nSecond one.\n")
    assert load_texts(str(tmp_path / "a.txt")) == ["First paragraph.", "Second one."]
    rows = [{"content": "one"}, {"content": "two"}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_texts(str(tmp_path / "b.jsonl"), text_column="content") == ["one", "two"]
    with pytest.raises(PtqError, match="has no 'text' field; set calibration.text_column"):
        load_texts(str(tmp_path / "b.jsonl"))
    with pytest.raises(PtqError, match="not found"):
        load_texts(str(tmp_path / "missing.txt"))


def test_datasets_by_path(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "alpha beta"}\n{"text": "gamma"}\n')
    assert load_texts(str(folder), split="train") == ["alpha beta", "gamma"]
    with pytest.raises(PtqError, match="cannot load calibration dataset"):
        load_texts(str(tmp_path / "no-such-dataset"))


def test_dataset_object_and_lists(tokenizer):
    import datasets

    data = datasets.Dataset.from_dict({"text": load_texts("builtin-eval")[:50]})
    from_dataset = calibration_batches(tokenizer, data, samples=4, seq_len=32, seed=0)
    from_list = calibration_batches(tokenizer, data["text"], samples=4, seq_len=32, seed=0)
    assert from_dataset.shape == (4, 32) and torch.equal(from_dataset, from_list)
    ids = [torch.arange(10), torch.arange(10, 20)]
    assert calibration_batches(None, ids, samples=1, seq_len=1, seed=0).shape == (2, 10)


def test_windows_are_seeded(tokenizer):
    stream = token_stream(tokenizer, load_texts("builtin-eval")[:100])
    a, b = sample_windows(stream, 8, 64, seed=1), sample_windows(stream, 8, 64, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, sample_windows(stream, 8, 64, seed=2))
    assert stream[0].item() == tokenizer.bos_token_id


def test_too_short(tokenizer):
    with pytest.raises(PtqError, match="fewer than one sample of seq_len=512"):
        calibration_batches(tokenizer, ["just a few words"], samples=1, seq_len=512, seed=0)
