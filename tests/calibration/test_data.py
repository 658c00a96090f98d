"""Calibration data from every supported source, tokenized into seeded windows."""

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

import ptq.calibration.data as data_module
from ptq.calibration.data import (
    calibration_batches,
    dataset_texts,
    load_texts,
    sample_windows,
    stream_tokens,
    token_stream,
)
from ptq.errors import PtqError
from ptq.models import bundled_model_path


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

    def refuse(self, *args, **kwargs):  # as chmod 0 does for anyone but root
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", refuse)
    with pytest.raises(PtqError, match="cannot read calibration file '.*a.txt': Permission denied$"):
        load_texts(path)


def test_dataset_split_is_read(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "from train"}\n')
    (folder / "validation.jsonl").write_text('{"text": "from validation"}\n{"text": "and more"}\n')
    assert load_texts(str(folder)) == ["from train"]
    assert load_texts(str(folder), split="validation") == ["from validation", "and more"]
    with pytest.raises(PtqError, match="cannot load calibration dataset '.*ds' \\(split 'test'\\): ValueError: .*split"):
        load_texts(str(folder), split="test")


def test_calibration_batches_pass_split_and_config_name(tokenizer, monkeypatch):
    import datasets

    calls = []

    def load_dataset(name, config_name=None, *, split, streaming=False):  # stands in for the Hub: no network in tests
        calls.append((name, config_name, split, streaming))
        return datasets.Dataset.from_dict({"body": load_texts("builtin-eval")[:50]}).to_iterable_dataset()

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    batches = calibration_batches(tokenizer, "org/corpus", samples=2, seq_len=16, seed=0, text_column="body",
                                  split="validation", config_name="en")
    assert batches.shape == (2, 16) and calls == [("org/corpus", "en", "validation", True)]  # streamed
    calibration_batches(tokenizer, "org/corpus", samples=2, seq_len=16, seed=0, text_column="body")
    assert calls[-1] == ("org/corpus", None, "train", True)


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


# -- conversations through the chat template --------------------------------------------

TEMPLATE = "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"


def with_template(template: str):
    tokenizer = transformers.AutoTokenizer.from_pretrained(bundled_model_path())  # the session's stays without one
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer():
    return with_template(TEMPLATE)


def conversations(n: int, start: int = 0) -> list[list[dict]]:
    texts = load_texts("builtin-eval")[start : start + 2 * n]
    pairs = zip(texts[::2], texts[1::2])
    return [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in pairs]


def jsonl_file(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_conversations_are_rendered_by_the_chat_template(chat_tokenizer):
    chats = conversations(30)
    rendered = [chat_tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]
    expected = [t for text in rendered for t in chat_tokenizer(text, add_special_tokens=False)["input_ids"]]
    stream = token_stream(chat_tokenizer, chats)
    assert torch.equal(stream, torch.tensor(expected))
    # the template's special tokens only: one <s> per message, none added by the tokenizer
    assert (stream == chat_tokenizer.bos_token_id).sum().item() == 2 * len(chats)


def test_every_form_of_chat_data_gives_the_same_windows(chat_tokenizer, tmp_path):
    import datasets

    chats = conversations(30)
    rows = [{"id": i, "messages": chat} for i, chat in enumerate(chats)]
    folder = tmp_path / "ds"
    folder.mkdir()
    jsonl_file(folder / "train.jsonl", rows)
    table = datasets.Dataset.from_list(rows)
    want = sample_windows(token_stream(chat_tokenizer, chats), 4, 64, seed=0)
    path = jsonl_file(tmp_path / "chat.jsonl", rows)
    for data in [chats, rows, path, str(folder), table, table.to_iterable_dataset()]:
        assert torch.equal(calibration_batches(chat_tokenizer, data, samples=4, seq_len=64, seed=0), want), data
    assert load_texts(str(tmp_path / "chat.jsonl")) == chats


def test_the_column_rule(chat_tokenizer, tmp_path):
    import datasets

    chats, texts = conversations(20), load_texts("builtin-eval")[100:120]
    as_chat = batches(chats, chat_tokenizer)
    as_text = batches(texts, chat_tokenizer)
    both = [{"text": text, "messages": chat} for text, chat in zip(texts, chats)]
    renamed = [{"body": text, "chat": chat} for text, chat in zip(texts, chats)]
    for rows in (both, jsonl_file(tmp_path / "both.jsonl", both), datasets.Dataset.from_list(both)):
        assert torch.equal(batches(rows, chat_tokenizer), as_chat)  # unset: 'messages' if present
        assert torch.equal(batches(rows, chat_tokenizer, text_column="text"), as_text)
        assert torch.equal(batches(rows, chat_tokenizer, messages_column="messages"), as_chat)
    for rows in (renamed, jsonl_file(tmp_path / "renamed.jsonl", renamed)):
        assert torch.equal(batches(rows, chat_tokenizer, messages_column="chat"), as_chat)
        assert torch.equal(batches(rows, chat_tokenizer, text_column="body"), as_text)
    only_text = [{"text": text} for text in texts]
    assert torch.equal(batches(only_text, chat_tokenizer), as_text)  # unset, no 'messages': 'text'
    with pytest.raises(PtqError, match="text_column \\('text'\\) and messages_column \\('messages'\\) are both set"):
        batches(both, chat_tokenizer, text_column="text", messages_column="messages")
    with pytest.raises(PtqError, match="renamed.jsonl:1 has no 'messages' field; set calibration.messages_column"):
        batches(str(tmp_path / "renamed.jsonl"), chat_tokenizer, messages_column="messages")
    no_text = "dataset has no column 'text' \\(columns: body, chat\\); set calibration.text_column"
    with pytest.raises(PtqError, match=no_text):
        batches(datasets.Dataset.from_list(renamed), chat_tokenizer)


def test_conversations_need_a_chat_template(tokenizer, tmp_path):
    path = jsonl_file(tmp_path / "chat.jsonl", [{"messages": chat} for chat in conversations(3)])
    message = (r"calibration data holds conversations \(.*chat.jsonl:1\), but tokenizer '.*' has no chat template; "
               "give a text column or a tokenizer with one$")
    with pytest.raises(PtqError, match=message):
        batches(path, tokenizer)
    assert torch.equal(batches(path, with_template(TEMPLATE)), batches(conversations(3), with_template(TEMPLATE)))


def test_a_template_that_refuses_a_conversation(tmp_path):
    refusing = with_template("{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    path = jsonl_file(tmp_path / "chat.jsonl", [{"messages": chat} for chat in conversations(3)])
    with pytest.raises(PtqError, match="chat.jsonl:1: the chat template refused the conversation: .*system first"):
        batches(path, refusing)


@pytest.mark.parametrize(
    "messages,problem",
    [
        ('"hello"', "it is a string, not a list"),
        ("null", "it is null, not a list"),
        ('["hello"]', "message 0 is a string, not an object"),
        ('[{"role": "user"}]', "message 0 has no 'content'"),
        ('[{"content": "hi"}]', "message 0 has no 'role'"),
        ('[{"role": "user", "content": "hi"}, {"role": "user", "content": 5}]',
         "message 1's 'content' is a number, not a string"),
        ('[{"role": null, "content": "hi"}]', "message 0's 'role' is null, not a string"),
    ],
)
def test_malformed_conversations_name_the_line(tmp_path, messages, problem):
    path = write_bytes(tmp_path / "m.jsonl", f'{{"messages": []}}\n{{"messages": {messages}}}\n'.encode())
    message = f"m.jsonl:2: 'messages' is not a conversation: {problem}; give a list of"
    with pytest.raises(PtqError, match=re.escape(message)):
        load_texts(path)


def test_malformed_conversations_name_the_row():
    import datasets

    good = [{"role": "user", "content": "hi"}]
    table = datasets.Dataset.from_list([{"messages": good}, {"messages": [{"role": "user", "content": None}]}])
    message = "dataset row 1: 'messages' is not a conversation: message 0's 'content' is null"
    with pytest.raises(PtqError, match=re.escape(message)):
        batches(table, with_template(TEMPLATE))
    with pytest.raises(PtqError, match=re.escape("calibration data[1] is not a conversation: message 0 is a string")):
        batches([good, ["hi"]], with_template(TEMPLATE))
    message = "calibration data[0]: 'messages' is not a conversation: it is an object"
    with pytest.raises(PtqError, match=re.escape(message)):
        batches([{"messages": {"role": "user"}}], with_template(TEMPLATE))


# -- reading only as far as the windows need ------------------------------------------------

def test_stream_length():
    assert stream_tokens(128, 512) == 1 << 20  # the floor: 2^20 tokens
    assert stream_tokens(1024, 2048) == 4 * 1024 * 2048


def first_documents(tokenizer, texts: list[str], tokens: int) -> list[str]:
    """The texts up to and including the one whose tokens bring the stream to `tokens`."""
    total = 0
    for i, text in enumerate(texts):
        total += len(tokenizer(text)["input_ids"])
        if total >= tokens:
            return texts[: i + 1]
    return texts


def test_sources_are_read_only_as_far_as_needed(tokenizer, tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(data_module, "STREAM_FLOOR", 3000)  # stream_tokens(2, 64) is 3000 tokens
    texts = load_texts("builtin-eval")[:600]
    head = first_documents(tokenizer, texts, 3000)
    assert len(head) < 100
    want = sample_windows(token_stream(tokenizer, head), 2, 64, seed=0)
    # a broken last line or byte that is never read
    lines = "".join(json.dumps({"text": t}) + "\n" for t in texts)
    jsonl = write_bytes(tmp_path / "big.jsonl", lines.encode() + b"{\n")
    txt = write_bytes(tmp_path / "big.txt", "\n\n".join(texts).encode() + b"\n\n\xff\n")
    read = []

    def rows():
        for text in texts:
            read.append(text)
            yield {"text": text}

    streamed = datasets.IterableDataset.from_generator(rows)  # columns known from its first row only
    for data in (jsonl, txt, streamed, texts):
        assert torch.equal(calibration_batches(tokenizer, data, samples=2, seq_len=64, seed=0), want), data
    assert 0 < len(read) < len(texts)
    with pytest.raises(PtqError, match="big.jsonl:601 is not a JSON object"):
        load_texts(jsonl)  # all of it
    with pytest.raises(PtqError, match="big.txt' is not UTF-8"):
        load_texts(txt)


def test_the_bundled_text_is_read_whole(tokenizer, monkeypatch):
    monkeypatch.setattr(data_module, "STREAM_FLOOR", 1000)
    stream = token_stream(tokenizer, load_texts("builtin"))
    assert len(stream) > 500_000
    assert torch.equal(calibration_batches(tokenizer, "builtin", samples=128, seq_len=512, seed=0),
                       sample_windows(stream, 128, 512, seed=0))
