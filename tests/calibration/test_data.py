"""Calibration data from every supported source, tokenized into seeded windows."""

import json
import re
from pathlib import Path

import pytest
import torch

from ptq.calibration.data import calibration_batches, dataset_texts, load_texts, sample_windows, token_stream
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


def write_bytes(path, data: bytes):
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "value,found",
    [("null", "null"), ("12345", "a number"), ("1.5", "a number"), ("true", "a boolean"),
     ('["a", "b"]', "a list"), ('{"a": "b"}', "an object")],
)
def test_jsonl_text_that_is_no_string(tmp_path, value, found):
    path = write_bytes(tmp_path / "b.jsonl", b'{"text": "fine"}\n' + f'{{"text": {value}}}\n'.encode())
    with pytest.raises(PtqError, match=f"b.jsonl:2: 'text' is {found}, not a string; each line needs its text as a JSON string$"):
        load_texts(path)


def test_jsonl_lines_must_be_objects(tmp_path):
    with pytest.raises(PtqError, match="b.jsonl:1 is a list, not a JSON object"):
        load_texts(write_bytes(tmp_path / "b.jsonl", b'["text"]\n'))
    with pytest.raises(PtqError, match="b.jsonl:2 is not a JSON object"):
        load_texts(write_bytes(tmp_path / "b.jsonl", b'{"text": "a"}\n{"text": \n'))


def test_jsonl_lines_end_at_newlines_only(tmp_path):
    path = write_bytes(tmp_path / "b.jsonl", '{"text": "a\u2028b"}\r\n{"text": "c"}\n'.encode())
    assert load_texts(path) == ["a\u2028b", "c"]


def test_blank_texts_are_skipped_and_no_text_is_an_error(tmp_path):
    jsonl = write_bytes(tmp_path / "b.jsonl", b'{"text": ""}\n\n  \n{"text": " \\n "}\n{"text": "kept"}\n')
    assert load_texts(jsonl) == ["kept"]
    for name, data in [("e.jsonl", b""), ("w.jsonl", b'{"text": ""}\n \n{"text": "  "}\n'),
                       ("e.txt", b""), ("w.txt", b" \n\n\t\n  \n")]:
        with pytest.raises(PtqError, match=f"calibration file '.*{name}' has no text"):
            load_texts(write_bytes(tmp_path / name, data))


@pytest.mark.parametrize("name", ["a.txt", "a.jsonl"])
def test_files_must_be_utf8(tmp_path, name):
    text = b'{"text": "caf\xe9"}\n' if name.endswith("jsonl") else b"caf\xe9\n"
    offset = text.index(b"\xe9")
    with pytest.raises(PtqError, match=f"'.*{name}' is not UTF-8 text \\(byte offset {offset}\\); convert it to UTF-8$"):
        load_texts(write_bytes(tmp_path / name, text))
    # a byte-order mark is no text
    assert load_texts(write_bytes(tmp_path / name, b"\xef\xbb\xbf" + text.replace(b"\xe9", b"\xc3\xa9"))) == ["café"]


def test_folders_and_unreadable_files(tmp_path, monkeypatch):
    (tmp_path / "notes.txt").mkdir()
    with pytest.raises(PtqError, match="calibration file '.*notes.txt' is a directory, not a file; give a .txt file"):
        load_texts(str(tmp_path / "notes.txt"))
    path = write_bytes(tmp_path / "a.txt", b"text\n")

    def refuse(self):  # as chmod 0 does for anyone but root
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)
    with pytest.raises(PtqError, match="cannot read calibration file '.*a.txt': Permission denied$"):
        load_texts(path)


def test_dataset_split_is_read(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "from train"}\n')
    (folder / "validation.jsonl").write_text('{"text": "from validation"}\n{"text": "and more"}\n')
    assert load_texts(str(folder)) == ["from train"]
    assert load_texts(str(folder), split="validation") == ["from validation", "and more"]
    with pytest.raises(PtqError, match="cannot load calibration dataset '.*ds' \\(split 'test'\\): ValueError: Unknown split"):
        load_texts(str(folder), split="test")


def test_calibration_batches_pass_split_and_config_name(tokenizer, monkeypatch):
    import datasets

    calls = []

    def load_dataset(name, config_name=None, *, split):  # stands in for the Hub: no network in tests
        calls.append((name, config_name, split))
        return datasets.Dataset.from_dict({"body": load_texts("builtin-eval")[:50]})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    batches = calibration_batches(tokenizer, "org/corpus", samples=2, seq_len=16, seed=0, text_column="body",
                                  split="validation", config_name="en")
    assert batches.shape == (2, 16) and calls == [("org/corpus", "en", "validation")]
    calibration_batches(tokenizer, "org/corpus", samples=2, seq_len=16, seed=0, text_column="body")
    assert calls[-1] == ("org/corpus", None, "train")


def test_dataset_text_columns():
    import datasets

    data = datasets.Dataset.from_dict({"text": ["one", None, "", "  ", "two"], "n": [1, 2, 3, 4, 5],
                                       "words": [["a"], ["b"], ["c"], ["d"], ["e"]]})
    assert dataset_texts(data) == ["one", "two"]  # missing values (None) and blank strings are skipped
    with pytest.raises(PtqError, match="dataset column 'n' holds int values \\(row 0\\), not text; set calibration.text_column"):
        dataset_texts(data, "n")
    with pytest.raises(PtqError, match="dataset column 'words' holds list values"):
        dataset_texts(data, "words")
    with pytest.raises(PtqError, match="dataset column 'text' has no text"):
        dataset_texts(datasets.Dataset.from_dict({"text": [None, " "]}))
    with pytest.raises(PtqError, match="is a DatasetDict \\(splits: train\\); pick one split"):
        dataset_texts(datasets.DatasetDict({"train": data}))


IDS = torch.arange(40).reshape(4, 10)


def batches(data, tokenizer=None, **options):
    return calibration_batches(tokenizer, data, samples=2, seq_len=8, seed=0, **options)


def test_token_ids_are_used_as_given():
    assert torch.equal(batches(IDS), IDS)
    assert torch.equal(batches(IDS.int()), IDS) and batches(IDS.int()).dtype == torch.long
    assert torch.equal(batches(IDS[0]), IDS[:1])  # 1-D: one row
    assert torch.equal(batches(iter([IDS[:2], IDS[2]])), IDS[:3])  # any iterable of tensors
    assert torch.equal(batches(IDS, vocab_size=40), IDS)


@pytest.mark.parametrize(
    "data,message",
    [
        (torch.rand(4, 10) * 4096, "must be an integer tensor, not torch.float32"),
        ([IDS.half()], "must be an integer tensor, not torch.float16"),
        (IDS > 5, "must be an integer tensor, not torch.bool"),
        (IDS.reshape(2, 2, 10), "are 1-D [tokens] or 2-D [rows, tokens], not 3-D [2, 2, 10]"),
        (torch.empty(0, dtype=torch.long), "is empty (shape [0])"),
        (torch.empty(3, 0, dtype=torch.long), "is empty (shape [3, 0])"),
        (torch.empty(0, 5, dtype=torch.long), "is empty (shape [0, 5])"),
        ([], "calibration data is empty"),
        ((), "calibration data is empty"),
        ([IDS, IDS[:, :5]], "must all have the same length"),
        (["some text", IDS[0]], "must be all texts or all token-id tensors, not a list of Tensor, str"),
        (["some text", None], "not a list of NoneType, str"),
        (5, "must be texts, a datasets.Dataset, or token-id tensors, not int"),
        ({"text": ["a"]}, "not dict"),
        (IDS - 1, "token id -1 is negative"),
    ],
)
def test_unusable_calibration_data(data, message):
    with pytest.raises(PtqError, match=re.escape(message)):
        batches(data)


def test_token_ids_outside_the_vocabulary(tokenizer):
    ids = torch.tensor([[1, 2, 5000, 3]])
    with pytest.raises(PtqError, match="token id 5000 is outside the model's vocabulary of 4096"):
        batches(ids, vocab_size=4096)
    texts = load_texts("builtin-eval")[:20]  # a tokenizer whose ids the model does not know
    with pytest.raises(PtqError, match="is outside the model's vocabulary of 100; use the model's own tokenizer"):
        batches(texts, tokenizer, vocab_size=100)


def test_blank_texts_in_lists(tokenizer):
    texts = load_texts("builtin-eval")[:20]
    assert torch.equal(batches(texts, tokenizer), batches(["", *texts, " \n"], tokenizer))
    with pytest.raises(PtqError, match="calibration texts are all empty"):
        batches(["", "  "], tokenizer)
