"""Calibration and evaluation text, turned into token batches.

Text sources: the bundled Python-documentation prose ("builtin", held-out part
"builtin-eval"), a local .txt file (paragraphs split on blank lines) or .jsonl file (one
object per line with a text column), or any `datasets` dataset by name or path. Texts are
tokenized paragraph by paragraph (with the tokenizer's special tokens) into one stream,
from which seeded random windows of seq_len tokens are drawn.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ptq.errors import PtqError

BUILTIN = {"builtin": "calib.txt", "builtin-eval": "eval.txt"}
TEXT_SUFFIXES = (".txt", ".md", ".rst")  # read as paragraphs split on blank lines


def _shown(value: object, limit: int = 80) -> str:
    """A user value for a message, cut to `limit` characters."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def builtin_text(name: str = "builtin") -> str:
    return resources.files("ptq.calib_data").joinpath(BUILTIN[name]).read_text(encoding="utf-8")


def _paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def load_texts(
    dataset: str = "builtin",
    *,
    split: str = "train",
    text_column: str = "text",
    config_name: str | None = None,
) -> list[str]:
    """The texts of a named source: builtin, builtin-eval, a .txt/.jsonl path, or a dataset.

    Blank paragraphs and lines are skipped; a file with no text left is an error.
    """
    if dataset in BUILTIN:
        return _paragraphs(builtin_text(dataset))
    path = Path(dataset)
    if path.suffix not in (*TEXT_SUFFIXES, ".jsonl"):
        return _datasets_texts(dataset, split, text_column, config_name)
    text = _read_file(path)
    texts = _jsonl_texts(path, text, text_column) if path.suffix == ".jsonl" else _paragraphs(text)
    if not texts:
        raise PtqError(f"calibration file '{_shown(path)}' has no text; give a file with some text in it")
    return texts


def _read_file(path: Path) -> str:
    """A calibration file's UTF-8 text (without a byte-order mark); PtqError if unreadable."""
    try:
        info = path.stat()
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL in the name
        raise PtqError(f"calibration file '{_shown(path)}' not found") from None
    except OSError as error:  # e.g. a name too long
        raise PtqError(f"cannot read calibration file '{_shown(path)}': {error.strerror or error}") from None
    if stat.S_ISDIR(info.st_mode):
        raise PtqError(f"calibration file '{_shown(path)}' is a directory, not a file; give a {path.suffix} file")
    try:
        return path.read_bytes().decode("utf-8").removeprefix("\ufeff")
    except OSError as error:  # PermissionError and the like
        raise PtqError(f"cannot read calibration file '{_shown(path)}': {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise PtqError(
            f"calibration file '{_shown(path)}' is not UTF-8 text (byte offset {error.start}); convert it to UTF-8"
        ) from None


def _jsonl_texts(path: Path, text: str, text_column: str) -> list[str]:
    """The non-blank strings of `text_column`, one JSON object per line; blank lines skipped."""
    texts = []
    for number, line in enumerate(text.split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        where = f"{_shown(path)}:{number}"
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError, or an integer of over 4300 digits
            raise PtqError(f"{where} is not a JSON object; a .jsonl file has one per line") from None
        if not isinstance(row, dict):
            raise PtqError(f"{where} is {_json_type(row)}, not a JSON object; a .jsonl file has one per line")
        if text_column not in row:
            raise PtqError(f"{where} has no '{_shown(text_column)}' field; set calibration.text_column")
        value = row[text_column]
        if not isinstance(value, str):
            raise PtqError(
                f"{where}: '{_shown(text_column)}' is {_json_type(value)}, not a string; "
                "each line needs its text as a JSON string"
            )
        if value.strip():
            texts.append(value)
    return texts


def _json_type(value: Any) -> str:
    names = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
             list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _datasets_texts(name: str, split: str, text_column: str, config_name: str | None) -> list[str]:
    import datasets

    try:
        data = datasets.load_dataset(name, config_name, split=split)
    except Exception as error:  # datasets raises many types: report any as a user error
        config = "" if config_name is None else f", config '{_shown(config_name)}'"
        raise PtqError(
            f"cannot load calibration dataset '{_shown(name)}' (split '{_shown(split)}'{config}): "
            f"{type(error).__name__}: {_shown(str(error).splitlines()[0] if str(error) else '', 200)}; "
            "use 'builtin', a .txt/.jsonl file, or a datasets name reachable from here"
        ) from None
    return dataset_texts(data, text_column)


def dataset_texts(data: Any, text_column: str = "text") -> list[str]:
    """The non-blank texts of a datasets.Dataset's text column.

    None entries (a missing value in a string column) and blank strings are skipped;
    anything else that is not a string (numbers, lists: not a text column) is an error.
    """
    if isinstance(data.column_names, dict):  # a DatasetDict: one list of columns per split
        raise PtqError(
            f"calibration data is a DatasetDict (splits: {', '.join(data.column_names)}); pick one split, e.g. data['train']"
        )
    if text_column not in data.column_names:
        raise PtqError(
            f"dataset has no column '{_shown(text_column)}' (columns: {_shown(', '.join(data.column_names), 200)}); "
            "set calibration.text_column"
        )
    texts = []
    for row, value in enumerate(data[text_column]):
        if value is not None and not isinstance(value, str):
            raise PtqError(
                f"dataset column '{_shown(text_column)}' holds {type(value).__name__} values (row {row}), "
                "not text; set calibration.text_column to a text column"
            )
        if value and value.strip():
            texts.append(value)
    if not texts:
        raise PtqError(f"dataset column '{_shown(text_column)}' has no text (all entries are empty)")
    return texts


def token_stream(tokenizer: Any, texts: Iterable[str]) -> Tensor:
    """All texts tokenized (with special tokens) and concatenated: int64 [tokens]."""
    ids = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    return torch.tensor([t for row in ids for t in row], dtype=torch.long)


def sample_windows(stream: Tensor, samples: int, seq_len: int, seed: int) -> Tensor:
    """`samples` windows of seq_len tokens at seeded random offsets: [samples, seq_len]."""
    if len(stream) < seq_len:
        raise PtqError(
            f"calibration text has {len(stream)} tokens, fewer than one sample of seq_len={seq_len}; "
            "give more text or lower calibration.seq_len"
        )
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.randint(0, len(stream) - seq_len + 1, (samples,), generator=generator)
    return torch.stack([stream[o : o + seq_len] for o in offsets.tolist()])


def calibration_batches(
    tokenizer: Any,
    data: Any,
    *,
    samples: int,
    seq_len: int,
    seed: int,
    text_column: str = "text",
    split: str = "train",
    config_name: str | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Token windows [samples, seq_len] from any supported form of calibration data.

    data: a list of strings, a datasets.Dataset, integer token-id tensors (used as they
    are: 1-D [tokens] is one row, 2-D [rows, tokens]; an iterable of them is
    concatenated), or a source name for `load_texts` (split, config_name and text_column
    choose what of a dataset is read). vocab_size: the model's; token ids outside it are
    refused.
    """
    if not isinstance(data, (str, Tensor)) and not hasattr(data, "column_names"):
        data = _as_list(data)
    ids = _given_token_ids(data)
    if ids is None:
        texts = None if isinstance(data, str) else _given_texts(data, text_column)
        if tokenizer is None:
            raise PtqError("calibration text needs a tokenizer: pass tokenizer=..., or give token-id tensors as data")
        if texts is None:  # a source name, read once a tokenizer is known
            texts = load_texts(data, split=split, text_column=text_column, config_name=config_name)
        ids = sample_windows(token_stream(tokenizer, texts), samples, seq_len, seed)
    _check_vocabulary(ids, vocab_size)
    return ids


def _as_list(data: Any) -> list:
    """The items of an iterable of texts or token-id tensors; PtqError if none or not iterable."""
    if not isinstance(data, Iterable) or isinstance(data, (bytes, dict)):
        raise PtqError(
            f"calibration data must be texts, a datasets.Dataset, or token-id tensors, not {type(data).__name__}"
        )
    items = list(data)
    if not items:
        raise PtqError("calibration data is empty; give texts, a datasets.Dataset, or token-id tensors")
    return items


def _given_token_ids(data: Any) -> Tensor | None:
    """data's token-id rows [rows, tokens] if it is token-id tensors, else None."""
    if isinstance(data, Tensor):
        return _token_rows(data)
    if not isinstance(data, list) or not all(isinstance(t, Tensor) for t in data):
        return None
    rows = [_token_rows(t) for t in data]
    if len({r.shape[1] for r in rows}) != 1:
        raise PtqError("token-id tensors given as calibration data must all have the same length")
    return torch.cat(rows)


def _token_rows(ids: Tensor) -> Tensor:
    """An integer token-id tensor as int64 rows [rows, tokens]; PtqError for anything else."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise PtqError(
            f"token ids given as calibration data must be an integer tensor, not {ids.dtype}; "
            "tokenize text (or pass the texts) instead"
        )
    if ids.dim() not in (1, 2):
        raise PtqError(
            f"token-id tensors given as calibration data are 1-D [tokens] or 2-D [rows, tokens], "
            f"not {ids.dim()}-D {list(ids.shape)}"
        )
    if ids.numel() == 0:
        raise PtqError(f"token-id tensor given as calibration data is empty (shape {list(ids.shape)})")
    return ids.long().reshape(-1, ids.shape[-1])


def _given_texts(data: Any, text_column: str) -> list[str]:
    """The non-blank texts of a datasets.Dataset or a list of strings; PtqError otherwise."""
    if hasattr(data, "column_names"):
        return dataset_texts(data, text_column)
    kinds = sorted({type(item).__name__ for item in data})
    if kinds != ["str"]:
        raise PtqError(
            f"calibration data must be all texts or all token-id tensors, not a list of {', '.join(kinds)}"
        )
    texts = [text for text in data if text.strip()]
    if not texts:
        raise PtqError("calibration texts are all empty; give some text")
    return texts


def _check_vocabulary(ids: Tensor, vocab_size: int | None) -> None:
    """PtqError if a token id is negative or not below vocab_size (when known)."""
    low, high = ids.min().item(), ids.max().item()
    if low < 0:
        raise PtqError(f"token id {low} is negative; token ids count from 0")
    if vocab_size is not None and high >= vocab_size:
        raise PtqError(
            f"token id {high} is outside the model's vocabulary of {vocab_size}; "
            "use the model's own tokenizer (or token ids below its vocab_size)"
        )
