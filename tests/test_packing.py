"""Packing is bit-exact: round trips for every width, and compressed-tensors' layout (weights and zero points)."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from torch import nn

from ptq.algorithms import compiled
from ptq.algorithms.rtn import rtn
from ptq.modules import QuantLinear
from ptq.packing import dequantize_packed, pack_int32, packed_width, unpack_int32
from ptq.schemes import QuantArgs, Scheme


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 32, 33, 100, 256])
def test_round_trip_every_width(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, n), generator=g).to(torch.int8)
    packed = pack_int32(values, bits)
    assert packed.dtype == torch.int32 and packed.shape == (6, packed_width(n, bits))
    assert torch.equal(unpack_int32(packed, bits, n), values)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_large_weight_packed_in_passes_as_in_one(bits, monkeypatch):
    # rows are packed a few at a time (PACK_ELEMENTS): the result is the one-pass packing
    import ptq.packing

    g = torch.Generator().manual_seed(bits)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (37, 96), generator=g).to(torch.int8)
    whole = pack_int32(values, bits)
    monkeypatch.setattr(ptq.packing, "PACK_ELEMENTS", 96 * 5)  # 5 rows a pass, the last pass 2 rows
    assert torch.equal(pack_int32(values, bits), whole)
    assert torch.equal(unpack_int32(whole, bits, 96), values)


def test_known_int4_layout():
    # element j of a row sits in word j // 8 at bit 4 * (j % 8), offset by +8
    values = torch.tensor([[-8, -7, 0, 7, 1, 2, 3, 4, 5]], dtype=torch.int8)
    packed = pack_int32(values, 4)
    unsigned = [v + 8 for v in values[0].tolist()]
    word0 = sum(u << (4 * j) for j, u in enumerate(unsigned[:8]))
    word0 = word0 - (1 << 32) if word0 >= 1 << 31 else word0
    assert packed.tolist() == [[word0, unsigned[8]]]


def test_three_bits_straddle_words():
    # element 10 of a 3-bit row starts at bit 30 and spills into word 1
    values = torch.zeros(1, 12, dtype=torch.int8)
    values[0, 10] = 3  # unsigned 7 = 0b111: bits 30, 31 in word 0 and bit 0 in word 1
    packed = pack_int32(values, 3)
    unsigned = (values.long() + 4)[0]
    stream = sum(int(u) << (3 * j) for j, u in enumerate(unsigned))
    words = [(stream >> (32 * w)) & 0xFFFFFFFF for w in range(2)]
    assert packed.tolist() == [[w - (1 << 32) if w >= 1 << 31 else w for w in words]]


@pytest.mark.parametrize("bits", range(1, 9))
def test_matches_compressed_tensors(bits):
    # ptq keeps its own packing (its unpack runs on the GPU without a Python loop); the
    # layout is compressed-tensors', bit for bit, in both directions
    g = torch.Generator().manual_seed(bits)
    values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, 200), generator=g).to(torch.int8)
    assert torch.equal(pack_int32(values, bits), pack_to_int32(values, bits))
    assert torch.equal(unpack_from_int32(pack_int32(values, bits), bits, values.shape), values)
    assert torch.equal(unpack_int32(pack_to_int32(values, bits), bits, 200), values)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("out_features", [80, 128, 11])
def test_zero_points_packed_as_compressed_tensors_packs_them(bits, out_features):
    # zero points [out, groups] are packed along the OUTPUT dim: int32 [ceil(out * bits / 32), groups]
    linear = nn.Linear(256, out_features)
    scheme = Scheme(weights=QuantArgs(num_bits=bits, symmetric=False, strategy="group", group_size=64))
    qw = rtn(linear.weight.detach(), scheme.weights, torch.bfloat16)
    stored = QuantLinear.from_quantized(linear, qw, scheme).weight_zero_point
    expected = pack_to_int32(qw.zero.to(torch.int8), bits, packed_dim=0)
    assert stored.dtype == torch.int32 and stored.shape == (packed_width(out_features, bits), 4)
    assert torch.equal(stored, expected)
    assert torch.equal(unpack_from_int32(stored, bits, qw.zero.shape, packed_dim=0), qw.zero.to(torch.int8))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 31, 33, 100, 576])
def test_compiled_packing_writes_the_torch_words(bits, n, monkeypatch):
    # on a CPU the compiled library packs (packing.c); the torch code is its reference. The
    # values include both extremes, and come as a slice of wider rows (a row stride > n)
    import ptq.packing

    assert compiled.unavailable() is None  # built at install wherever a C compiler is
    g = torch.Generator().manual_seed(bits * 100 + n)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    wide = torch.randint(lo, hi + 1, (9, n + 5), generator=g).to(torch.int8)
    wide[0, :n], wide[1, :n] = lo, hi
    values = wide[:, :n]
    packed = pack_int32(values, bits)
    unpacked = unpack_int32(packed, bits, n)
    monkeypatch.setattr(ptq.packing, "_compiled_for", lambda *_: False)
    assert torch.equal(packed, pack_int32(values, bits))
    assert torch.equal(unpacked, unpack_int32(packed, bits, n))
    assert torch.equal(unpacked, values)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("groups", [1, 3, 8])  # 1: per channel
def test_compiled_dequantize_gives_the_torch_bits(bits, scale_dtype, symmetric, groups):
    """dequantize_packed against primitives.dequantize of the unpacked codes: every
    code of the width, scales from bf16's smallest normal to near its largest (products
    overflowing to inf), zero points at both ends."""
    from ptq.primitives import dequantize

    assert compiled.unavailable() is None
    g = torch.Generator().manual_seed(bits * 10 + groups)
    rows, n = 37, 24 * groups
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (rows, n), generator=g).to(torch.int8)
    q[0], q[1] = lo, hi
    scale = (torch.rand(rows, groups, generator=g) * 2).exp2().mul(torch.randn(rows, groups, generator=g).sign())
    scale[2], scale[3], scale[4] = 1.2e-38, 3e38, 1e-3
    scale = scale.to(scale_dtype)
    zero = None if symmetric else torch.randint(lo, hi + 1, (rows, groups), generator=g).to(torch.int8)
    if zero is not None:
        zero[5], zero[6] = lo, hi
    expected = dequantize(q, scale, zero)
    got = dequantize_packed(pack_int32(q, bits), bits, n, scale, zero)
    assert got.dtype == scale_dtype and torch.isinf(expected).any() and expected.isfinite().any()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    into = torch.full((rows, n), 7.0, dtype=scale_dtype)
    assert dequantize_packed(pack_int32(q, bits), bits, n, scale, zero, out=into) is into
    assert torch.equal(into.view(torch.uint8), expected.view(torch.uint8))


def test_compiled_dequantize_declines_what_it_does_not_compute():
    q = torch.zeros(4, 64, dtype=torch.int8)
    words = pack_int32(q, 4)
    assert dequantize_packed(words, 4, 64, torch.ones(4, 2, dtype=torch.float16), None) is None
    assert dequantize_packed(words, 4, 64, torch.ones(1, 1), None) is None  # per tensor
    assert dequantize_packed(words, 4, 64, torch.ones(4, 3), None) is None  # 3 does not divide 64
    assert dequantize_packed(words, 4, 64, torch.ones(4, 2), None, out=torch.empty(4, 64).t()) is None


def test_rejects_bad_width():
    with pytest.raises(ValueError, match="1..8"):
        pack_int32(torch.zeros(1, 4, dtype=torch.int8), 9)
