"""Checks on weight files before any library reads them: safetensors headers and shard indexes.

A safetensors file is an 8-byte little-endian header length, a JSON header (tensor name ->
dtype, shape and [begin, end) byte offsets into the data that follows) and the data. A
truncated or corrupt file makes the safetensors library raise its own error type (and a
huge header length makes it try to allocate that much), so the header is checked here
first. An index (model.safetensors.index.json) names the shard of every tensor; each
shard must be a file inside the model folder. Every problem raises PtqError with one line.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path, PurePosixPath, PureWindowsPath

from ptq.errors import PtqError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4,
}  # other dtypes are left to the safetensors library


def shorten(value: object, limit: int = 80) -> str:
    """str(value) on one line, at most limit characters (for echoing what a file holds)."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def first_line(error: BaseException, limit: int = 160) -> str:
    """The first line of an exception's message (a library's can run to pages), shortened."""
    text = str(error).strip()
    return shorten(text.splitlines()[0] if text else type(error).__name__, limit)


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in path; what names the file in messages (e.g. "config.json")."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise PtqError(f"cannot read {what}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise PtqError(f"{what} is not UTF-8 text; replace it with the JSON file it should be") from None
    except json.JSONDecodeError as error:
        raise PtqError(f"{what} is not valid JSON ({error.msg} at line {error.lineno}); fix or replace it") from None
    if not isinstance(data, dict):
        raise PtqError(f"{what} holds a JSON {type(data).__name__}, not an object; fix or replace it")
    return data


def safetensors_header(path: Path) -> dict[str, dict]:
    """The header of a safetensors file (tensor name -> dtype, shape, data_offsets), after
    checking that it parses and that every tensor's bytes lie within the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            head = file.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is not None and length <= min(size - 8, MAX_HEADER_BYTES):
                raw = file.read(length)
    except OSError as error:
        raise PtqError(f"cannot read {path.name}: {error.strerror or error}") from None
    if length is None:
        raise _invalid(path, f"only {size} bytes")
    if length > MAX_HEADER_BYTES:
        raise _invalid(path, f"header length {length} is over {MAX_HEADER_BYTES // 10**6} MB")
    if length > size - 8:
        raise _invalid(path, f"header length {length} is past the end of the {size}-byte file; truncated?")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _invalid(path, "its header is not JSON") from None
    if not isinstance(header, dict):
        raise _invalid(path, "its header is not a JSON object")
    data_bytes = size - 8 - length
    for name, info in header.items():
        if name != "__metadata__":
            _check_entry(path, name, info, data_bytes)
    return header


def _check_entry(path: Path, name: str, info: object, data_bytes: int) -> None:
    if not isinstance(info, dict):
        raise _invalid(path, f"tensor '{shorten(name)}' has no dtype/shape/data_offsets")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(info.get("dtype"), str) or not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise _invalid(path, f"tensor '{shorten(name)}' has a malformed dtype, shape or data_offsets")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise _invalid(path, f"tensor '{shorten(name)}' lies at bytes {begin}..{end} of {data_bytes}; truncated?")
    bits = DTYPE_BITS.get(info["dtype"])
    if bits is not None and end - begin != (math.prod(shape) * bits + 7) // 8:
        raise _invalid(path, f"tensor '{shorten(name)}' of shape {shorten(shape)} has {end - begin} bytes")


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _invalid(path: Path, reason: str) -> PtqError:
    return PtqError(f"{path.name} is not a valid safetensors file ({reason})")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, checked: model.safetensors if there is one
    (transformers reads it first), else the shards named by the index; [] if neither exists.
    """
    if (folder / SINGLE).is_file():
        files = [folder / SINGLE]
    elif (folder / INDEX).is_file():
        files = [_shard(folder, name) for name in sorted(set(index_weight_map(folder).values()))]
    else:
        return []
    for file in files:
        safetensors_header(file)
    return files


def index_weight_map(folder: Path) -> dict[str, str]:
    """The weight_map (tensor name -> shard file name) of the folder's index."""
    index = read_json_object(folder / INDEX, INDEX)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise PtqError(f"{INDEX} has no weight_map (tensor name -> shard file); fix or replace it")
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise PtqError(f"{INDEX} maps '{shorten(name)}' to {shorten(shard)}, not a file name")
    return weight_map


def _shard(folder: Path, name: str) -> Path:
    """The shard file name names, which must lie inside folder."""
    escapes = any(
        pure.is_absolute() or ".." in pure.parts or pure.drive for pure in (PurePosixPath(name), PureWindowsPath(name))
    )
    if escapes or not name:
        raise PtqError(f"{INDEX} names shard '{shorten(name)}' outside the model folder; shards must be files in it")
    path = folder / name
    if not path.is_file():
        raise PtqError(f"{INDEX} names shard '{shorten(name)}', which does not exist in the model folder")
    return path
