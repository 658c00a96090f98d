"""Safetensors shards written as their tensors arrive (a streamed model, ptq.streaming).

safetensors.torch.save_file takes every tensor of a file at once and copies them into
one buffer before writing; a streamed model's checkpoint is produced one module at a
time and must not be held. ShardWriter writes each tensor's bytes to disk as it is
added, into one part file per element size (8, 4, 2, 1 bytes), and when a shard is full
writes the safetensors file: the 8-byte header length, the JSON header, then the parts
copied in decreasing element size, so that every tensor is aligned to its element size
as save_file aligns them. Tensors held at once: the one being written.
"""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
COPY_CHUNK = 16 * 1024**2


@dataclass
class _Shard:
    parts: dict[int, BinaryIO] = field(default_factory=dict)  # element size -> its part file, open
    entries: dict[str, tuple[str, list[int], int, int, int]] = field(default_factory=dict)  # name -> dtype, shape, size, start, end
    nbytes: int = 0


class ShardWriter:
    """add() writes tensors into the current shard (a new one once max_shard_bytes would be
    passed); finish() names the shards as ptq.checkpoint.writer.write_weights does
    (model.safetensors alone, or model-0000i-of-0000n.safetensors with
    model.safetensors.index.json). The files are the tensors save_file would write."""

    def __init__(self, folder: Path, max_shard_bytes: int):
        self.folder, self.max_shard_bytes = folder, max_shard_bytes
        self._shard = _Shard()
        self._written: list[tuple[Path, list[str]]] = []  # finished shard file, its tensor names
        self.total_bytes = 0
        self._finished = False

    def add(self, tensors: dict[str, Tensor]) -> None:
        for name, tensor in tensors.items():
            if tensor.dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"tensor '{name}' has dtype {tensor.dtype}, which this writer does not store")
            nbytes = tensor.numel() * tensor.element_size()
            if self._shard.entries and self._shard.nbytes + nbytes > self.max_shard_bytes:
                self._close_shard()
            self._write(name, tensor, nbytes)

    def _write(self, name: str, tensor: Tensor, nbytes: int) -> None:
        shard, size = self._shard, tensor.element_size()
        if size not in shard.parts:
            shard.parts[size] = open(self._part_path(len(self._written), size), "wb")
        part = shard.parts[size]
        start = part.tell()
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
        part.write(memoryview(data.numpy()))
        shard.entries[name] = (SAFETENSORS_DTYPES[tensor.dtype], list(tensor.shape), size, start, start + nbytes)
        shard.nbytes += nbytes
        self.total_bytes += nbytes

    def _part_path(self, index: int, size: int) -> Path:
        return self.folder / f".shard-{index:05d}.part{size}"

    def _close_shard(self) -> None:
        shard, index = self._shard, len(self._written)
        for part in shard.parts.values():
            part.close()
        base, offset = {}, 0
        for size in sorted(shard.parts, reverse=True):  # larger elements first: every tensor aligned
            base[size] = offset
            offset += self._part_path(index, size).stat().st_size
        header = {"__metadata__": {"format": "pt"}}
        for name, (dtype, shape, size, start, end) in shard.entries.items():
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [base[size] + start, base[size] + end]}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        path = self.folder / f".shard-{index:05d}.safetensors"
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(text)))
            out.write(text)
            for size in sorted(shard.parts, reverse=True):
                with open(self._part_path(index, size), "rb") as part:
                    shutil.copyfileobj(part, out, COPY_CHUNK)
                self._part_path(index, size).unlink()
        self._written.append((path, list(shard.entries)))
        self._shard = _Shard()

    def finish(self) -> None:
        """Write the last shard and name the files; again, it does nothing (the files are
        finished before the rest of a checkpoint when its tensors are read back first)."""
        if self._finished:
            return
        self._finished = True
        if self._shard.entries or not self._written:
            self._close_shard()
        if len(self._written) == 1:
            self._written[0][0].rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, (path, names) in enumerate(self._written, 1):
            filename = f"model-{i:05d}-of-{len(self._written):05d}.safetensors"
            path.rename(self.folder / filename)
            weight_map.update(dict.fromkeys(names, filename))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
