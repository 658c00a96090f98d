"""Calibration and evaluation text, turned into token batches.

Documents come from ptq.calibration.sources: the bundled text, .txt/.jsonl files,
`datasets` datasets (streamed), datasets.Dataset/IterableDataset objects, or Python lists
of texts, conversations or rows. The column read from rows: `text_column` if set (texts),
else `messages_column` if set (conversations), else `messages` if the source has it, else
`text` (details in that module). A text is tokenized with the tokenizer's special
tokens; a conversation is rendered by the tokenizer's chat template
(`apply_chat_template(messages, tokenize=False)`) and that text tokenized without adding
special tokens (the template holds them). A tokenizer without a chat template and
conversations: PtqError.

How far a source is read: documents are read and tokenized in order into one stream until
it holds stream_tokens(samples, seq_len) = max(4 x samples x seq_len, 2^20) tokens (the
document that reaches it is kept whole), or the source ends; `samples` windows of seq_len
tokens are then drawn from that stream at seeded random offsets. A big source is thus read
only that far, from its start (shuffle a sorted source first), and the windows depend only
on the source, the tokenizer, samples, seq_len and seed. The bundled text (530k tokens
with the bundled tokenizer) is always read whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from ptq.calibration.sources import (  # noqa: F401  (load_texts and friends: used from here)
    BUILTIN,
    Columns,
    Conversation,
    Document,
    Located,
    builtin_text,
    check_source,
    dataset_texts,
    first_line,
    given_documents,
    load_texts,
    shown,
    source_documents,
)
from ptq.errors import PtqError

STREAM_FACTOR = 4  # a stream holds 4x the tokens its windows take, for variety ...
STREAM_FLOOR = 1 << 20  # ... and at least 2^20 tokens (about 4 MB of English text)
CHUNK_DOCUMENTS, CHUNK_CHARS = 256, 1 << 20  # documents tokenized in one call, at most


def stream_tokens(samples: int, seq_len: int) -> int:
    """How many tokens calibration_batches reads from a source before it stops."""
    return max(STREAM_FACTOR * samples * seq_len, STREAM_FLOOR)


def token_stream(tokenizer: Any, texts: Iterable[Document], limit: int | None = None) -> Tensor:
    """Documents tokenized and concatenated: int64 [tokens].

    Texts with the tokenizer's special tokens, conversations through its chat template.
    limit: stop after the document that brings the stream to `limit` tokens.
    """
    return _token_stream(tokenizer, ((f"document {i}", doc) for i, doc in enumerate(texts)), limit)


def _token_stream(tokenizer: Any, documents: Iterable[Located], limit: int | None) -> Tensor:
    pieces, total = [], 0
    for chunk in _chunks(documents):
        rows = _encode(tokenizer, chunk)
        if limit is not None:
            rows = _until(rows, limit - total)
        pieces.append(torch.tensor([t for row in rows for t in row], dtype=torch.long))
        total += len(pieces[-1])
        if limit is not None and total >= limit:
            break  # the documents are not read further
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)


def _until(rows: list[list[int]], tokens: int) -> list[list[int]]:
    """The rows up to and including the one that brings their length to `tokens`."""
    for i, row in enumerate(rows):
        tokens -= len(row)
        if tokens <= 0:
            return rows[: i + 1]
    return rows


def _chunks(documents: Iterable[Located]) -> Iterator[list[Located]]:
    """The documents in lists of at most CHUNK_DOCUMENTS, or about CHUNK_CHARS characters."""
    chunk, chars = [], 0
    for where, document in documents:
        chunk.append((where, document))
        chars += len(document) if isinstance(document, str) else sum(len(m["content"]) for m in document)
        if len(chunk) >= CHUNK_DOCUMENTS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _encode(tokenizer: Any, chunk: list[Located]) -> list[list[int]]:
    """Each document's token ids: texts with special tokens, rendered conversations without."""
    chat = [not isinstance(document, str) for _, document in chunk]
    texts = [_render(tokenizer, where, doc) if is_chat else doc for (where, doc), is_chat in zip(chunk, chat)]
    ids: dict[int, list[int]] = {}
    for kind in set(chat):
        picked = [i for i, is_chat in enumerate(chat) if is_chat == kind]
        rows = tokenizer([texts[i] for i in picked], add_special_tokens=not kind)["input_ids"]
        ids.update(zip(picked, rows))
    return [ids[i] for i in range(len(chunk))]


def _render(tokenizer: Any, where: str, conversation: Conversation) -> str:
    """A conversation as the tokenizer's chat template writes it; PtqError without one."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise PtqError(
            f"calibration data holds conversations ({where}), but tokenizer '{shown(name)}' has no chat template; "
            "give a text column or a tokenizer with one"
        )
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception as error:  # a Jinja template raises what its author chose
        raise PtqError(f"{where}: the chat template refused the conversation: {first_line(error)}") from None
    if not isinstance(text, str):
        raise PtqError(f"{where}: the chat template gave {type(text).__name__}, not text")
    return text


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
    text_column: str | None = None,
    messages_column: str | None = None,
    split: str = "train",
    config_name: str | None = None,
    vocab_size: int | None = None,
) -> Tensor:
    """Token windows [samples, seq_len] from any supported form of calibration data.

    data: a source name (see the module docstring; split and config_name choose what of a
    dataset is read), a datasets.Dataset or IterableDataset, a list of texts, of
    conversations (lists of {role, content}) or of rows (dicts; text_column and
    messages_column choose the column as for files), or integer token-id tensors (used as
    they are: 1-D [tokens] is one row, 2-D [rows, tokens]; an iterable of them is
    concatenated). Text is read only as far as stream_tokens(samples, seq_len) tokens.
    vocab_size: the model's; token ids outside it are refused.
    """
    columns = Columns(text_column, messages_column)
    if not isinstance(data, (str, Tensor)) and not hasattr(data, "column_names"):
        data = _as_list(data)
    ids = _given_token_ids(data)
    if ids is None:
        documents = None if isinstance(data, str) else given_documents(data, columns)
        if tokenizer is None:
            raise PtqError("calibration text needs a tokenizer: pass tokenizer=..., or give token-id tensors as data")
        if documents is None:  # a source name, read once a tokenizer is known
            documents = source_documents(data, split, columns, config_name)
        limit = None if isinstance(data, str) and data in BUILTIN else stream_tokens(samples, seq_len)
        ids = sample_windows(_token_stream(tokenizer, documents, limit), samples, seq_len, seed)
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
