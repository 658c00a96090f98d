"""Calibration sources read as documents: texts, or conversations for a chat template.

Sources: the bundled Python-documentation prose ("builtin", held-out part "builtin-eval"),
a local .txt file (paragraphs split on blank lines; "\\r\\n" read as "\\n"), a local .jsonl
file (one JSON object per line), any `datasets` dataset by name or path (streamed), a
datasets.Dataset or IterableDataset, or a list of texts, conversations or rows (dicts)
given in Python.

Each paragraph, line or row gives one document. The column (.jsonl: field) read from each
row: `text_column` if set (its values are texts); else `messages_column` if set (its values
are conversations); else `messages` if the source has that column (judged by its column
names; a .jsonl file or a list of rows: by its first row), else `text`. A conversation is
a list of {"role": str, "content": str} objects (other keys are kept for the template).
Blank texts, empty conversations and missing values (None in a dataset) are skipped; a
source with no document left is an error.

Sources are read lazily, as their documents are asked for (ptq.calibration.data stops
asking once it has enough tokens); problems are PtqErrors naming the file:line or row.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ptq.errors import PtqError

BUILTIN = {"builtin": "calib.txt", "builtin-eval": "eval.txt"}
TEXT_SUFFIXES = (".txt", ".md", ".rst")  # read as paragraphs split on blank lines
DATASET_BATCH = 256  # dataset rows read at a time

Conversation = list[dict[str, str]]  # [{"role": ..., "content": ...}, ...]
Document = str | Conversation  # a text, or a conversation for the chat template
Located = tuple[str, Document]  # where a document comes from (file:line, row), and it


def shown(value: object, limit: int = 80) -> str:
    """A user value for a message, cut to `limit` characters."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Columns:
    """The column choice a user made: text_column, messages_column, or neither (None)."""

    text: str | None = None
    messages: str | None = None

    def __post_init__(self) -> None:
        if self.text is not None and self.messages is not None:
            raise PtqError(
                f"calibration.text_column ('{shown(self.text)}') and messages_column ('{shown(self.messages)}') "
                "are both set; set the one column to read"
            )

    def pick(self, names: Iterable[str]) -> tuple[str, bool]:
        """The column to read from a source with these column names, and whether it holds conversations."""
        if self.text is not None or self.messages is not None:
            return (self.text, False) if self.text is not None else (self.messages, True)
        return ("messages", True) if "messages" in names else ("text", False)

    @staticmethod
    def hint(chat: bool) -> str:
        return "set calibration.messages_column" if chat else "set calibration.text_column"


def builtin_text(name: str = "builtin") -> str:
    return resources.files("ptq.calib_data").joinpath(BUILTIN[name]).read_text(encoding="utf-8")


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def load_texts(
    dataset: str = "builtin",
    *,
    split: str = "train",
    text_column: str | None = None,
    messages_column: str | None = None,
    config_name: str | None = None,
) -> list[Document]:
    """All documents of a named source: builtin, builtin-eval, a .txt/.jsonl path, or a dataset.

    Texts, or conversations (see the module's column rule). Blank documents are skipped; a
    source with none left is an error.
    """
    columns = Columns(text_column, messages_column)
    return [doc for _, doc in source_documents(dataset, split, columns, config_name)]


def check_source(
    dataset: str,
    *,
    split: str = "train",
    text_column: str | None = None,
    messages_column: str | None = None,
    config_name: str | None = None,
    documents: int = 1000,
) -> None:
    """Open a named source and check its first `documents` documents: PtqError if unusable.

    The cheap check before a model is loaded; calibration_batches reads the rest it needs.
    """
    columns = Columns(text_column, messages_column)
    for count, _ in enumerate(source_documents(dataset, split, columns, config_name), 1):
        if count >= documents:
            break


def source_documents(name: str, split: str, columns: Columns, config_name: str | None) -> Iterator[Located]:
    """The documents of a named source, read as they are asked for."""
    if name in BUILTIN:
        return ((f"{name} paragraph {i}", p) for i, p in enumerate(_paragraphs(builtin_text(name)), 1))
    path = Path(name)
    if path.suffix not in (*TEXT_SUFFIXES, ".jsonl"):
        return _datasets_documents(name, split, columns, config_name)
    lines = _file_lines(path)
    if path.suffix == ".jsonl":
        documents = _row_documents(_jsonl_rows(path, lines), columns, "each line needs its text as a JSON string")
    else:
        documents = _text_paragraphs(path, lines)
    return _not_empty(documents, f"calibration file '{shown(path)}' has no text; give a file with some text in it")


def _not_empty(documents: Iterator[Located], message: str) -> Iterator[Located]:
    """The documents, then PtqError(message) at the end if there were none."""
    found = False
    for item in documents:
        found = True
        yield item
    if not found:
        raise PtqError(message)


def _file_lines(path: Path) -> Iterator[tuple[int, str]]:
    """A UTF-8 file's lines, numbered from 1, each with its "\\n" (no byte-order mark)."""
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL in the name
        raise PtqError(f"calibration file '{shown(path)}' not found") from None
    except OSError as error:  # e.g. a name too long
        raise PtqError(f"cannot read calibration file '{shown(path)}': {error.strerror or error}") from None
    if stat.S_ISDIR(info.st_mode):
        raise PtqError(f"calibration file '{shown(path)}' is a directory, not a file; give a {path.suffix} file")
    try:
        with path.open("rb") as file:
            offset = 0
            for number, raw in enumerate(file, 1):  # binary lines end at b"\n" only, never at U+2028
                yield number, _decoded(path, raw, offset, first=number == 1)
                offset += len(raw)
    except OSError as error:  # PermissionError and the like
        raise PtqError(f"cannot read calibration file '{shown(path)}': {error.strerror or error}") from None


def _decoded(path: Path, raw: bytes, offset: int, *, first: bool) -> str:
    """One line's UTF-8 text; offset: where the line starts in the file, for the message."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PtqError(
            f"calibration file '{shown(path)}' is not UTF-8 text (byte offset {offset + error.start}); "
            "convert it to UTF-8"
        ) from None
    return line.removeprefix("\ufeff") if first else line


def _text_paragraphs(path: Path, lines: Iterable[tuple[int, str]]) -> Iterator[Located]:
    """Non-blank paragraphs, split on "\\n\\n" as _paragraphs splits a whole text ("\\r\\n" read as "\\n")."""
    held: list[str] = []  # the lines of the paragraph so far
    start = 1
    for number, line in lines:
        if line.endswith("\r\n"):
            line = line[:-2] + "\n"
        if line == "\n" and held and held[-1].endswith("\n"):  # a "\n\n": the paragraph ends
            paragraph = "".join(held)[:-1].strip()
            if paragraph:
                yield f"{shown(path)}:{start}", paragraph
            held, start = [], number + 1
        else:
            held.append(line)
    paragraph = "".join(held).strip()
    if paragraph:
        yield f"{shown(path)}:{start}", paragraph


def _jsonl_rows(path: Path, lines: Iterable[tuple[int, str]]) -> Iterator[tuple[str, dict]]:
    """One JSON object per non-blank line, with its file:line."""
    for number, line in lines:
        if not line.strip():
            continue
        where = f"{shown(path)}:{number}"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, or an integer of over 4300 digits
            raise PtqError(f"{where} is not a JSON object; a .jsonl file has one per line") from None
        if not isinstance(row, dict):
            raise PtqError(f"{where} is {_json_type(row)}, not a JSON object; a .jsonl file has one per line")
        yield where, row


def _row_documents(rows: Iterable[tuple[str, dict]], columns: Columns, each: str) -> Iterator[Located]:
    """The chosen column's non-blank documents; the column is picked on the first row.

    each: what a text must be, for the message when it is not a string.
    """
    column, chat = None, False
    for where, row in rows:
        if column is None:
            column, chat = columns.pick(row)
        if column not in row:
            raise PtqError(f"{where} has no '{shown(column)}' field; {Columns.hint(chat)}")
        value = row[column]
        if chat:
            document = _conversation(f"{where}: '{shown(column)}'", value)
        elif isinstance(value, str):
            document = value if value.strip() else None
        else:
            raise PtqError(f"{where}: '{shown(column)}' is {_json_type(value)}, not a string; {each}")
        if document:
            yield where, document


def _conversation(label: str, value: Any) -> Conversation:
    """value as a conversation; PtqError naming `label` if it is not a list of {role, content} strings.

    Keys that are None (an Arrow column's absent fields) are left out.
    """
    problem = _conversation_problem(value)
    if problem:
        raise PtqError(
            f"{label} is not a conversation: {problem}; "
            'give a list of {"role": ..., "content": ...} objects with string values'
        )
    return [{key: text for key, text in message.items() if text is not None} for message in value]


def _conversation_problem(value: Any) -> str | None:
    if not isinstance(value, list):
        return f"it is {_json_type(value)}, not a list"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is {_json_type(message)}, not an object"
        for key in ("role", "content"):
            if key not in message:
                return f"message {i} has no '{key}'"
            if not isinstance(message[key], str):
                return f"message {i}'s '{key}' is {_json_type(message[key])}, not a string"
    return None


def _json_type(value: Any) -> str:
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _datasets_documents(name: str, split: str, columns: Columns, config_name: str | None) -> Iterator[Located]:
    """A `datasets` dataset's documents, streamed: only the rows asked for are read."""
    import datasets

    config = "" if config_name is None else f", config '{shown(config_name)}'"
    source = f"calibration dataset '{shown(name)}' (split '{shown(split)}'{config})"
    try:
        data = datasets.load_dataset(name, config_name, split=split, streaming=True)
    except Exception as error:  # datasets raises many types: report any as a user error
        raise PtqError(
            f"cannot load {source}: {first_line(error)}; "
            "use 'builtin', a .txt/.jsonl file, or a datasets name reachable from here"
        ) from None
    yield from _dataset_documents(data, columns, source)


def first_line(error: Exception) -> str:
    return f"{type(error).__name__}: {shown(str(error).splitlines()[0] if str(error) else '', 200)}"


def dataset_texts(data: Any, text_column: str = "text") -> list[str]:
    """The non-blank texts of a datasets.Dataset's (or IterableDataset's) text column.

    None entries (a missing value in a string column) and blank strings are skipped;
    anything else that is not a string (numbers, lists: not a text column) is an error.
    """
    return [doc for _, doc in _dataset_documents(data, Columns(text=text_column))]


def _dataset_documents(data: Any, columns: Columns, source: str = "calibration dataset") -> Iterator[Located]:
    """The chosen column's non-blank documents of a datasets.Dataset or IterableDataset.

    Checks the columns at once; reads the rows as they are asked for.
    """
    names = data.column_names
    if isinstance(names, dict):  # a DatasetDict: one list of columns per split
        raise PtqError(
            f"calibration data is a DatasetDict (splits: {', '.join(names)}); pick one split, e.g. data['train']"
        )
    if names is None:  # an IterableDataset that knows its columns only from its first row
        first = next(iter(_rows(data, None, source)), {})
        names = list(first)
    column, chat = columns.pick(names)
    if column not in names:
        raise PtqError(
            f"dataset has no column '{shown(column)}' (columns: {shown(', '.join(names), 200)}); "
            f"{Columns.hint(chat)}"
        )
    return _not_empty(
        _dataset_values(_rows(data, column, source), column, chat),
        f"dataset column '{shown(column)}' has no text (all entries are empty)",
    )


def _dataset_values(values: Iterable[Any], column: str, chat: bool) -> Iterator[Located]:
    for row, value in enumerate(values):
        if chat:
            document = None if value is None else _conversation(f"dataset row {row}: '{shown(column)}'", value)
        elif value is None or isinstance(value, str):
            document = value if value and value.strip() else None
        else:
            raise PtqError(
                f"dataset column '{shown(column)}' holds {type(value).__name__} values (row {row}), "
                f"not text; {Columns.hint(False)} to a text column"
            )
        if document:
            yield f"dataset row {row}", document


def _rows(data: Any, column: str | None, source: str) -> Iterator[Any]:
    """A dataset's values of `column` (None: whole rows), read in batches as asked for."""
    try:
        if column is None:
            yield from data
            return
        for batch in data.select_columns([column]).iter(batch_size=DATASET_BATCH):
            yield from batch[column]
    except Exception as error:  # a broken shard, a lost connection: datasets raises many types
        raise PtqError(f"cannot read {source}: {first_line(error)}") from None


def given_documents(data: Any, columns: Columns) -> Iterator[Located]:
    """The documents of a dataset object or of a list of texts, conversations or rows.

    The kind of the list is checked at once; the documents are read as they are asked for.
    """
    if hasattr(data, "column_names"):
        return _dataset_documents(data, columns)
    kinds = sorted({type(item).__name__ for item in data})
    if kinds == ["str"]:
        texts = ((f"calibration data[{i}]", text) for i, text in enumerate(data) if text.strip())
        return _not_empty(texts, "calibration texts are all empty; give some text")
    if kinds == ["list"]:
        checked = ((f"calibration data[{i}]", _conversation(f"calibration data[{i}]", c)) for i, c in enumerate(data))
        return _not_empty(((w, c) for w, c in checked if c), "calibration conversations are all empty; give some")
    if kinds == ["dict"]:
        rows = _row_documents(((f"calibration data[{i}]", row) for i, row in enumerate(data)), columns,
                              "each row needs its text as a string")
        return _not_empty(rows, "calibration rows have no text; give some text")
    raise PtqError(
        f"calibration data must be all texts or all token-id tensors, not a list of {', '.join(kinds)}; "
        "texts are strings, conversations (lists of {role, content} dicts) or rows (dicts)"
    )
