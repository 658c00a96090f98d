"""The AWQ checkpoint layout (AutoAWQ "gemm"; transformers' and vLLM's "awq" quant_method).

Per quantized Linear `<name>`, 4-bit weights with unsigned integers u = q + 8 (0..15):

    qweight  int32 [in, out / 8]       u packed along the OUTPUT dimension, eight per word in
                                       AWQ's interleaved order: the nibble at bits 4k..4k+3 of
                                       word j holds output column 8j + ORDER[k]
    qzeros   int32 [groups, out / 8]   unsigned zero points, packed the same way
    scales   float16 [groups, out]

Dequantize: w[i, o] = (u[i, o] - zero[i // group_size, o]) * scales[i // group_size, o].
There is no g_idx: groups are contiguous runs of input columns (no activation order).
group_size -1 (AutoAWQ, GPTQModel) is one group of all the inputs.

AWQ stores a zero point for every group (config zero_point: true). ptq's symmetric weights
are written with the zero 8, which every gemm reader (AutoAWQ, GPTQModel, vLLM) reads as it
reads any zero; zero_point: false is not written, since AutoAWQ never writes gemm weights
without zeros and GPTQModel would then pick symmetric kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ptq.export.gptq import unsigned_zeros
from ptq.primitives import QuantizedWeight
from ptq.schemes import QuantArgs

BITS = 4
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within 8) held by nibble k
PER_WORD = 32 // BITS
SHIFTS = tuple(range(0, 32, BITS))


class AwqTensors(NamedTuple):
    qweight: Tensor  # int32 [in, out / 8]
    qzeros: Tensor  # int32 [groups, out / 8]
    scales: Tensor  # float16 [groups, out]


def shape_problem(args: QuantArgs, in_features: int, out_features: int) -> str | None:
    """Why a Linear of this shape and these args has no AWQ gemm layout, or None."""
    if args.num_bits != BITS:
        return f"AWQ holds 4-bit weights, not {args.num_bits}-bit"
    if out_features % PER_WORD:
        return f"AWQ packs 8 outputs per int32 word: out_features {out_features} is not a multiple of 8"
    return None


def pack(values: Tensor) -> Tensor:
    """Unsigned 4-bit integers [rows, n] (n a multiple of 8) to int32 [rows, n / 8], AWQ order."""
    rows, n = values.shape
    fields = values.to(torch.int64).reshape(rows, n // PER_WORD, PER_WORD)[:, :, list(ORDER)]
    shifts = torch.tensor(SHIFTS, dtype=torch.int64, device=values.device)
    words = (fields << shifts).sum(dim=-1)  # [rows, n / 8], 0..2^32-1
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack(words: Tensor) -> Tensor:
    """Inverse of pack: int32 [rows, n / 8] to unsigned integers [rows, n] (int16)."""
    rows, count = words.shape
    shifts = torch.tensor(SHIFTS, dtype=torch.int64, device=words.device)
    fields = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF  # [rows, n / 8, 8] in nibble order
    columns = torch.empty_like(fields)
    columns[:, :, list(ORDER)] = fields  # nibble k holds column ORDER[k]
    return columns.reshape(rows, count * PER_WORD).to(torch.int16)


def to_awq(qw: QuantizedWeight) -> AwqTensors:
    """The AWQ tensors of a 4-bit, weight-only QuantizedWeight without g_idx (the caller checks
    shape_problem); symmetric weights get the zero 8. Scales are rounded to float16."""
    assert qw.g_idx is None and qw.args.num_bits == BITS, "AWQ: 4 bits, no activation order"
    qweight = pack(qw.q.t().to(torch.int16) + (1 << (BITS - 1)))  # [in, out / 8]
    qzeros = pack(unsigned_zeros(qw).t())  # [groups, out / 8]
    scales = qw.scale.t().to(torch.float16).contiguous()  # [groups, out]
    return AwqTensors(qweight, qzeros, scales)


def from_awq(
    tensors: AwqTensors, *, group_size: int | None, symmetric: bool, scale_dtype: torch.dtype = torch.float16
) -> QuantizedWeight:
    """ptq's QuantizedWeight of one Linear's AWQ tensors, integers as stored (bit-exact with
    to_awq). group_size None: one group per row (per channel). symmetric: every zero must
    be 8 (the caller checks unpack(qzeros)); the weight then carries no zero point."""
    offset = 1 << (BITS - 1)
    args = QuantArgs(num_bits=BITS, symmetric=symmetric, strategy="group" if group_size else "channel",
                     group_size=group_size)
    q = (unpack(tensors.qweight) - offset).t().to(torch.int8).contiguous()  # [out, in]
    scale = tensors.scales.t().to(scale_dtype).contiguous()  # [out, groups]
    zero = None if symmetric else (unpack(tensors.qzeros) - offset).t().to(torch.int8).contiguous()
    return QuantizedWeight(q, scale, zero, None, args)
