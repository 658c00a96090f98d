"""Calibration sources read lazily, document by document, as a whole read would."""

import json
import random

import pytest

from ptq.calibration.sources import _paragraphs, check_source, dataset_texts, load_texts
from ptq.errors import PtqError


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize(
    "text", ["a\n\nb", "a\n\n\nb", "a\n\n\n\nb\n", "\n\na\n\n", "a\n \nb", "x\ny\n\n\n\n\nz", " \n\n\n q \n\n", "one"]
)
def test_txt_paragraphs_read_line_by_line_as_a_whole_text_splits(tmp_path, text):
    assert load_texts(write(tmp_path / "a.txt", text.encode())) == _paragraphs(text)


def test_txt_paragraphs_fuzz(tmp_path):
    rng = random.Random(0)
    for case in range(300):
        text = "".join(rng.choice("ab \n\n\n") for _ in range(rng.randrange(1, 40)))
        if text.strip():
            assert load_texts(write(tmp_path / f"{case}.txt", text.encode())) == _paragraphs(text), repr(text)


def test_txt_with_crlf_line_ends_has_paragraphs(tmp_path):
    assert load_texts(write(tmp_path / "w.txt", b"first\r\nline\r\n\r\nsecond\r\n")) == ["first\nline", "second"]


def test_check_source_reads_the_first_documents(tmp_path):
    good = "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(1000))
    check_source(write(tmp_path / "late.jsonl", (good + "{broken\n").encode()))  # line 1001 is not read
    with pytest.raises(PtqError, match="early.jsonl:3 is not a JSON object"):
        check_source(write(tmp_path / "early.jsonl", (good[:40] + "{broken\n").encode()))
    with pytest.raises(PtqError, match="chat.jsonl:1: 'messages' is not a conversation"):
        check_source(write(tmp_path / "chat.jsonl", b'{"messages": "hi"}\n'))
    with pytest.raises(PtqError, match="calibration file '.*none.txt' not found"):
        check_source(str(tmp_path / "none.txt"))
    with pytest.raises(PtqError, match="calibration file '.*blank.txt' has no text"):
        check_source(write(tmp_path / "blank.txt", b"\n \n\n"))
    with pytest.raises(PtqError, match="are both set"):
        check_source("builtin", text_column="text", messages_column="messages")


def test_dataset_dicts_of_either_kind_are_refused():
    import datasets

    table = datasets.Dataset.from_dict({"text": ["a"]})
    streamed = table.to_iterable_dataset()
    for data in (datasets.DatasetDict({"train": table}), datasets.IterableDatasetDict({"train": streamed})):
        with pytest.raises(PtqError, match="is a DatasetDict \\(splits: train\\); pick one split"):
            dataset_texts(data)
