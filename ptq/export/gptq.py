"""The GPTQ checkpoint layout (AutoGPTQ, GPTQModel; transformers' and vLLM's "gptq" quant_method).

Per quantized Linear `<name>`, with unsigned integers u = q + 2^(bits-1) (int4 -> 0..15):

    qweight  int32 [in * bits / 32, out]   u packed along the INPUT dimension, low bits first:
                                           one dense little-endian bit stream per output column
                                           (element i starts at bit i * bits; 3-bit elements 10
                                           and 21 of each 32 straddle two words)
    qzeros   int32 [groups, out * bits / 32]  unsigned zero points packed the same way along
                                           the OUTPUT dimension
    scales   float16 [groups, out]
    g_idx    int32 [in]                    group of each input column: i // group_size
                                           without activation order, any order with it
                                           (desc_act); all 0 per channel (group_size -1)

Dequantize: w[i, o] = (u[i, o] - zero[g_idx[i], o]) * scales[g_idx[i], o].

Zero points: checkpoint_format "gptq" (v1, what AutoGPTQ wrote and GPTQModel writes by
default) stores zero - 1 in each field; readers add one back (a symmetric int4 zero of 8 is
stored as 7). A zero of 0 would be stored as -1, which readers undo differently (GPTQModel
adds 0x11111111 to the whole word, carrying into the next field; AutoGPTQ's and vLLM's v1
kernels add 1 to each field): v1 cannot hold it, and `zero_problem` says so. "gptq_v2"
stores the zeros as they are. Reading follows GPTQModel (the reader transformers uses):
2, 4 and 8 bits add the whole-word constant, 3 bits add 1 to each field modulo 8.

The dense layout is compressed-tensors' (ptq.packing), transposed: qweight is weight_packed.T
and v2 qzeros are weight_zero_point.T, so these functions reuse ptq.packing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ptq.packing import pack_int32, unpack_int32
from ptq.primitives import QuantizedWeight
from ptq.schemes import QuantArgs

BITS = (2, 3, 4, 8)  # what transformers' GPTQConfig and GPTQModel's dense layout take
CHECKPOINT_FORMATS = ("gptq", "gptq_v2")  # "gptq" is v1
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


class GptqTensors(NamedTuple):
    qweight: Tensor  # int32 [in * bits / 32, out]
    qzeros: Tensor  # int32 [groups, out * bits / 32]
    scales: Tensor  # float16 [groups, out]
    g_idx: Tensor  # int32 [in]


def word_multiple(bits: int) -> int:
    """The multiple of a packed dimension that fills whole int32 words (32 for 3 bits)."""
    return 32 // bits if 32 % bits == 0 else 32


def shape_problem(args: QuantArgs, in_features: int, out_features: int) -> str | None:
    """Why a Linear of this shape and these args has no GPTQ layout, or None."""
    if args.num_bits not in BITS:
        return f"GPTQ holds {', '.join(map(str, BITS))}-bit weights, not {args.num_bits}-bit"
    multiple = word_multiple(args.num_bits)
    for what, n in (("in_features", in_features), ("out_features", out_features)):
        if n % multiple:
            return f"GPTQ packs {args.num_bits}-bit values in whole int32 words: {what} {n} is not a multiple of {multiple}"
    return None


def _pack_unsigned(values: Tensor, bits: int) -> Tensor:
    """Unsigned integers [rows, n] in 0..2^bits-1 packed densely along the last dim."""
    return pack_int32(values.to(torch.int16) - (1 << (bits - 1)), bits)


def _unpack_unsigned(words: Tensor, bits: int, n: int) -> Tensor:
    return unpack_int32(words, bits, n).to(torch.int16) + (1 << (bits - 1))


def _field_constant(bits: int) -> int:
    """The int32 word with 1 in each field (2, 4 and 8 bits), e.g. 0x11111111 for 4 bits."""
    return sum(1 << shift for shift in range(0, 32, bits))


def unsigned_zeros(qw: QuantizedWeight) -> Tensor:
    """qw's zero points as GPTQ counts them, unsigned: [out, groups] int16 (2^(bits-1) when symmetric)."""
    offset = 1 << (qw.args.num_bits - 1)
    if qw.zero is None:
        return torch.full(qw.scale.shape, offset, dtype=torch.int16, device=qw.scale.device)
    return qw.zero.to(torch.int16) + offset


def zero_problem(qw: QuantizedWeight) -> str | None:
    """Why v1 cannot store qw's zero points (a zero of 0 in some group), or None."""
    empty = int((unsigned_zeros(qw) == 0).sum())
    if empty:
        return (
            f"{empty} group(s) have the zero point 0 (unsigned), which GPTQ's v1 layout (zero - 1) cannot "
            "store: readers disagree on a stored -1"
        )
    return None


def scale_problem(scale: Tensor) -> str | None:
    """Why the scales do not fit float16, the format's scale dtype, or None."""
    if scale.numel() and float(scale.float().abs().max()) > FLOAT16_MAX:
        return f"a scale exceeds {FLOAT16_MAX:.0f}, the largest float16 (the format stores float16 scales)"
    return None


def to_gptq(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> GptqTensors:
    """The GPTQ tensors of a weight-only int QuantizedWeight (see the module docstring).

    The caller checks shape_problem, zero_problem (v1) and scale_problem first; scales are
    rounded to float16 (exact for bf16 scales in float16's normal range, 6.1e-5 to 65504)."""
    bits = qw.args.num_bits
    out_features, in_features = qw.q.shape
    groups = qw.scale.shape[1]
    qweight = pack_int32(qw.q, bits).t().contiguous()  # [in * bits / 32, out]
    zeros = unsigned_zeros(qw)  # [out, groups]
    if checkpoint_format == "gptq":
        assert int(zeros.min()) >= 1, "zero_problem: v1 cannot store a zero of 0"
        zeros = zeros - 1
    qzeros = _pack_unsigned(zeros.t(), bits)  # [groups, out * bits / 32]
    scales = qw.scale.t().to(torch.float16).contiguous()  # [groups, out]
    if qw.g_idx is not None:
        g_idx = qw.g_idx.to(torch.int32)
    else:
        size = in_features // groups
        g_idx = torch.arange(in_features, dtype=torch.int32, device=qw.q.device) // size
    return GptqTensors(qweight, qzeros.contiguous(), scales, g_idx.contiguous())


def decode_zeros(qzeros: Tensor, bits: int, out_features: int, checkpoint_format: str) -> Tensor:
    """Unsigned zero points [groups, out] (int16) from qzeros, as GPTQModel reads them."""
    if checkpoint_format == "gptq" and 32 % bits == 0:  # add 1 to each field, carrying as an int32 add does
        words = (qzeros.to(torch.int64) + _field_constant(bits)) & 0xFFFFFFFF
        qzeros = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
        return _unpack_unsigned(qzeros, bits, out_features)
    zeros = _unpack_unsigned(qzeros, bits, out_features)
    if checkpoint_format == "gptq":  # 3 bits: fields straddle words; GPTQModel adds 1 per field
        zeros = (zeros + 1) & ((1 << bits) - 1)
    return zeros


def from_gptq(
    tensors: GptqTensors,
    *,
    bits: int,
    group_size: int | None,
    symmetric: bool,
    checkpoint_format: str = "gptq",
    scale_dtype: torch.dtype = torch.float16,
    desc_act: bool = False,
) -> QuantizedWeight:
    """ptq's QuantizedWeight of one Linear's GPTQ tensors: integers as stored (bit-exact with
    to_gptq), g_idx (activation order "group") with desc_act or where it is not i // group_size.

    group_size None: per channel. symmetric: every zero must be 2^(bits-1) (checked by the
    caller with decode_zeros); the weight then carries no zero point."""
    out_features = tensors.scales.shape[1]
    in_features = tensors.g_idx.shape[0]
    args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy="group" if group_size else "channel",
                     group_size=group_size)
    q = unpack_int32(tensors.qweight.t().contiguous(), bits, in_features)  # [out, in] int8, signed
    scale = tensors.scales.t().to(scale_dtype).contiguous()  # [out, groups]
    zero = None
    if not symmetric:
        unsigned = decode_zeros(tensors.qzeros, bits, out_features, checkpoint_format)  # [groups, out]
        zero = (unsigned - (1 << (bits - 1))).t().to(torch.int8).contiguous()  # [out, groups]
    g_idx = tensors.g_idx.to(torch.int32)
    identity = torch.arange(in_features, device=g_idx.device) // (group_size or in_features)
    ordered = desc_act or not torch.equal(g_idx, identity.to(torch.int32))
    return QuantizedWeight(q, scale, zero, g_idx.contiguous() if ordered else None, args,
                           actorder="group" if ordered else None)
