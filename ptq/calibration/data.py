"""Calibration and evaluation text, turned into token batches.

Text sources: the bundled Python-documentation prose ("builtin", held-out part
"builtin-eval"), a local .txt file (paragraphs split on blank lines) or .jsonl file (one
object per line with a text column), or any `datasets` dataset by name or path. Texts are
tokenized paragraph by paragraph (with the tokenizer's special tokens) into one stream,
from which seeded random windows of seq_len tokens are drawn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ptq.errors import PtqError

BUILTIN = {"builtin": "calib.txt", "builtin-eval": "eval.txt"}


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
    """The texts of a named source: builtin, builtin-eval, a .txt/.jsonl path, or a dataset."""
    if dataset in BUILTIN:
        return _paragraphs(builtin_text(dataset))
    path = Path(dataset)
    if path.is_file() and path.suffix in (".txt", ".md", ".rst"):
        return _paragraphs(path.read_text(encoding="utf-8"))
    if path.is_file() and path.suffix == ".jsonl":
        return _jsonl_texts(path, text_column)
    if path.suffix in (".txt", ".md", ".rst", ".jsonl") and not path.exists():
        raise PtqError(f"calibration file '{path}' not found")
    return _datasets_texts(dataset, split, text_column, config_name)


def _jsonl_texts(path: Path, text_column: str) -> list[str]:
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise PtqError(f"{path}:{number} is not a JSON object; a .jsonl file has one per line") from None
        if not isinstance(row, dict) or text_column not in row:
            raise PtqError(f"{path}:{number} has no '{text_column}' field; set calibration.text_column")
        texts.append(str(row[text_column]))
    return texts


def _datasets_texts(name: str, split: str, text_column: str, config_name: str | None) -> list[str]:
    import datasets

    try:
        data = datasets.load_dataset(name, config_name, split=split)
    except Exception as error:  # datasets raises many types: report any as a user error
        raise PtqError(
            f"cannot load calibration dataset '{name}' (split '{split}'): {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}; use 'builtin', a .txt/.jsonl file, "
            "or a datasets name reachable from here"
        ) from None
    return dataset_texts(data, text_column)


def dataset_texts(data: Any, text_column: str = "text") -> list[str]:
    """The text column of a datasets.Dataset."""
    if text_column not in data.column_names:
        raise PtqError(
            f"dataset has no column '{text_column}' (columns: {', '.join(data.column_names)}); "
            "set calibration.text_column"
        )
    return [t for t in data[text_column] if t and t.strip()]


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
    tokenizer: Any, data: Any, *, samples: int, seq_len: int, seed: int, text_column: str = "text"
) -> Tensor:
    """Token windows [samples, seq_len] from any supported form of calibration data.

    data: a list of strings, a datasets.Dataset, a Tensor of token ids [n, seq_len], an
    iterable of 1-D/2-D token-id tensors, or a source name for `load_texts`.
    """
    if isinstance(data, Tensor):
        return data.long().reshape(-1, data.shape[-1])
    if not isinstance(data, str):  # a source name is read below, once a tokenizer is known
        if hasattr(data, "column_names"):
            data = dataset_texts(data, text_column)
        data = list(data)
        if data and isinstance(data[0], Tensor):
            rows = [t.long().reshape(-1, t.shape[-1]) for t in data]
            if len({r.shape[-1] for r in rows}) != 1:
                raise PtqError("token-id tensors given as calibration data must all have the same length")
            return torch.cat(rows)
        if not all(isinstance(t, str) for t in data):
            raise PtqError("calibration data must be texts, a datasets.Dataset, or token-id tensors")
    if tokenizer is None:
        raise PtqError("calibration text needs a tokenizer: pass tokenizer=..., or give token-id tensors as data")
    texts = load_texts(data, text_column=text_column) if isinstance(data, str) else data
    return sample_windows(token_stream(tokenizer, texts), samples, seq_len, seed)
