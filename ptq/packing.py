"""Dense int32 packing of signed integers, bit-exact with compressed-tensors' layout.

Each signed value of `bits` bits is offset by 2^(bits-1) (int4 -> 0..15) and written into
one little-endian bit stream per row: element j occupies bits [j*bits, (j+1)*bits) and
word j*bits // 32, spilling into the next word when it straddles a boundary (3, 5, 6, 7
bits). A row of n values takes ceil(n * bits / 32) int32 words.

On a CPU, int8 values are packed and unpacked by ptq's compiled library (packing.c, the
same words; unpacking a [3072, 576] W4 weight takes 0.35 ms against 1.7) when it was built;
the torch code here is the reference and runs everywhere else. There the codes are also
dequantized straight from their words (dequantize_packed: QuantLinear's dequantized weight).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ptq.algorithms import compiled


def _compiled_for(tensor: Tensor, dtype: torch.dtype) -> bool:
    """Whether the compiled library packs or unpacks this CPU tensor of dtype."""
    return tensor.device.type == "cpu" and tensor.dtype == dtype and tensor.dim() == 2 and compiled.unavailable() is None


def _word_positions(bits: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """For the 32 elements of one 32*bits-bit chunk: their word index and bit offset."""
    starts = torch.arange(32, device=device) * bits
    return starts // 32, starts % 32


def packed_width(n: int, bits: int) -> int:
    return math.ceil(n * bits / 32)


PACK_ELEMENTS = 1 << 20  # values packed per pass: the int64 temporaries stay near 10 MB each


def pack_int32(values: Tensor, bits: int) -> Tensor:
    """Pack signed integers [rows, n] along the last dim: int32 [rows, ceil(n*bits/32)].
    Rows are packed independently, a few at a time (PACK_ELEMENTS), so that a large weight's
    temporaries stay small."""
    if not 1 <= bits <= 8:
        raise ValueError(f"num_bits must be in 1..8 to pack, got {bits}")
    rows, n = values.shape
    if _compiled_for(values, torch.int8) and values.stride(1) == 1:
        out = torch.empty(rows, packed_width(n, bits), dtype=torch.int32)
        compiled.library()[0].ptq_pack_int32(values.data_ptr(), rows, n, values.stride(0), bits, out.data_ptr(),
                                             out.shape[1])
        return out
    per_pass = max(1, PACK_ELEMENTS // max(n, 1))
    if rows > per_pass:
        return torch.cat([_pack_rows(part, bits) for part in values.split(per_pass)])
    return _pack_rows(values, bits)


def _pack_rows(values: Tensor, bits: int) -> Tensor:
    rows, n = values.shape
    if 32 % bits == 0:  # 1, 2, 4, 8 bits: whole elements per word, no straddling
        return _pack_whole(values, bits)
    chunks = math.ceil(n / 32)
    unsigned = values.to(torch.int64) + (1 << (bits - 1))  # [rows, n] in 0..2^bits-1
    unsigned = torch.nn.functional.pad(unsigned, (0, chunks * 32 - n)).view(rows, chunks, 32)
    word, offset = _word_positions(bits, values.device)
    stream = torch.zeros(rows, chunks, bits + 1, dtype=torch.int64, device=values.device)
    # low part of each element into its word, the spill (if any) into the next word
    stream.index_add_(2, word, (unsigned << offset) & 0xFFFFFFFF)
    stream.index_add_(2, word + 1, unsigned >> (32 - offset))
    words = stream[:, :, :bits].reshape(rows, chunks * bits)[:, : packed_width(n, bits)]
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # two's complement
    return words.to(torch.int32).contiguous()


def _pack_whole(values: Tensor, bits: int) -> Tensor:
    """_pack_rows when elements do not straddle words: element k of each word shifted by
    k*bits and OR-ed in, in int32 (shifts wrap into the sign bit, as two's complement)."""
    rows, n = values.shape
    per_word = 32 // bits
    unsigned = values.to(torch.int32) + (1 << (bits - 1))  # [rows, n] in 0..2^bits-1
    unsigned = torch.nn.functional.pad(unsigned, (0, packed_width(n, bits) * per_word - n))
    fields = unsigned.view(rows, -1, per_word)  # [rows, words, per_word]
    words = fields[:, :, 0].clone()
    for k in range(1, per_word):
        words |= fields[:, :, k] << (k * bits)
    return words


def unpack_int32(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of pack_int32: int32 [rows, ceil(n*bits/32)] to signed int8 [rows, n]."""
    if not 1 <= bits <= 8:
        raise ValueError(f"num_bits must be in 1..8 to unpack, got {bits}")
    if _compiled_for(packed, torch.int32) and packed.shape[1] == packed_width(n, bits):
        packed = packed.contiguous()
        out = torch.empty(packed.shape[0], n, dtype=torch.int8)
        compiled.library()[0].ptq_unpack_int32(packed.data_ptr(), packed.shape[0], packed.shape[1], bits, n,
                                               out.data_ptr())
        return out
    rows = packed.shape[0]
    if 32 % bits == 0:  # 1, 2, 4, 8 bits: whole elements per word, no straddling
        per_word = 32 // bits
        shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * bits
        fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
        return (fields.reshape(rows, -1)[:, :n] - (1 << (bits - 1))).to(torch.int8)
    chunks = math.ceil(n / 32)
    words = packed.to(torch.int64) & 0xFFFFFFFF  # [rows, words] unsigned
    words = torch.nn.functional.pad(words, (0, chunks * bits + 1 - words.shape[1]))
    word, offset = _word_positions(bits, packed.device)
    index = (torch.arange(chunks, device=packed.device)[:, None] * bits + word).reshape(-1)
    low = words[:, index] >> offset.repeat(chunks)  # [rows, chunks*32]
    high = words[:, index + 1] << (32 - offset.repeat(chunks))
    unsigned = (low | high) & ((1 << bits) - 1)
    return (unsigned[:, :n] - (1 << (bits - 1))).to(torch.int8)


def dequantize_packed(words: Tensor, bits: int, n: int, scale: Tensor, zero: Tensor | None,
                      out: Tensor | None = None) -> Tensor | None:
    """(q - zero) · scale in the scale's dtype, [rows, n], for the codes q packed in int32
    words [rows, ceil(n·bits/32)] (pack_int32's layout), with per-group scales
    [rows, groups] (groups of n / groups consecutive codes; 1: per channel) and int8 zero
    points of that shape or None: what primitives.dequantize(unpack_int32(words, bits, n),
    scale, zero) holds, bit for bit, without the codes' tensor, on one thread (packing.c,
    ptq_dequantize_packed), into out ([rows, n] contiguous, the scale's dtype) where given.
    None where it does not
    apply (use torch): another device, a scale dtype other than float32 and bf16, scales
    not [rows, groups] dividing n, or no compiled library."""
    rows = words.shape[0]
    applies = (
        _compiled_for(words, torch.int32) and words.shape[1] == packed_width(n, bits) and scale.device.type == "cpu"
        and scale.dtype in (torch.float32, torch.bfloat16) and scale.dim() == 2 and scale.shape[0] == rows
        and scale.shape[1] > 0 and n % scale.shape[1] == 0
        and (zero is None or (zero.dtype == torch.int8 and zero.shape == scale.shape and zero.device.type == "cpu"))
        and (out is None or (out.shape == (rows, n) and out.dtype == scale.dtype and out.is_contiguous()))
    )
    if not applies:
        return None
    words, scale = words.contiguous(), scale.contiguous()
    zero = None if zero is None else zero.contiguous()
    out = torch.empty(rows, n, dtype=scale.dtype) if out is None else out
    codes = torch.empty(n, dtype=torch.int8)  # a row's codes: held here while the C code writes them
    compiled.library()[0].ptq_dequantize_packed(
        words.data_ptr(), words.shape[1], bits, n, scale.data_ptr(), compiled.KINDS[scale.dtype], scale.shape[1],
        None if zero is None else zero.data_ptr(), out.data_ptr(), rows, codes.data_ptr())
    return out
