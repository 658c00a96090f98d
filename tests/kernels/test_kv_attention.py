"""Decode attention over a quantized KV cache (ptq.kernels.kv_attention).

Test stores are built here from random codes and scales, packed by a test-side packer written from
the layout's definition, so the kernel's and the reference's unpacking are both checked against it.
Positions the kernel must not read (past `length`, and left padding) hold NaN where the format
allows it (fp8 codes, KIVI scales): reading one would turn the output into NaN.

Tolerances, stated once:
  reference vs float64 naive softmax(q k^T) v: atol = rtol = 1e-5 (fp32 dequantize and matmuls
      over <= 160 keys; the error is ~1e-6).
  kernel vs reference: atol = rtol = 2^-8 on out and atol = 2^-8 on lse. The kernel feeds tl.dot with
      fp16 operands (q, the dequantized K / V tile, the probabilities) and accumulates in fp32: each
      operand is rounded by 2^-11 relative, scores here are O(1..10), so out and lse move by ~1e-3.
  merge_attention: atol = rtol = 1e-5 (fp32 exp and sums).
Empty rows are exact: out 0 and lse -inf.
"""

import pytest
import torch

from ptq.kernels import kv_attention
from ptq.kernels.kv_attention import (
    QuantizedKV,
    attention_reference_dense,
    decode_attention,
    decode_attention_reference,
    dequantize_kv,
    is_supported,
    merge_attention,
)

KERNEL_TOL = dict(atol=2**-8, rtol=2**-8)
BITS = {"fp8": 8, "int8": 8, "int4": 4, "int2": 2}
NAN_FP8 = 0x7F


def pack_codes(codes, bits):
    """uint8 [..., D * bits / 8]: channel c into byte c // (8 / bits) at bit (c % (8 / bits)) * bits."""
    per = 8 // bits
    packed = torch.zeros(*codes.shape[:-1], codes.shape[-1] // per, dtype=torch.int64)
    for c in range(codes.shape[-1]):
        packed[..., c // per] |= codes[..., c].long() << ((c % per) * bits)
    return packed.to(torch.uint8)


def make_store(kind, B, H, S, D, length, G=16, pad=None, seed=0, device="cpu"):
    """(store, k, v): a random store and its float64 keys / values [B, H, length, D].

    pad[b] = number of left-padding tokens of row b: they and all positions >= length hold NaN
    where the format can (fp8 codes, KIVI scales).
    """
    gen = torch.Generator().manual_seed(seed)
    pad = pad or [0] * B
    unread = torch.ones(B, S, dtype=torch.bool)  # positions the kernel must not use
    for b in range(B):
        unread[b, pad[b]:length] = False
    if kind in ("fp8", "int8"):
        if kind == "fp8":  # every byte pattern but NaN: normals, subnormals, +-0, +-448
            raw = [torch.randint(0, 256, (B, H, S, D), generator=gen, dtype=torch.uint8) for _ in "kv"]
            raw = [torch.where((r & 0x7F) == NAN_FP8, 0, r) for r in raw]
            raw = [torch.where(unread[:, None, :, None], NAN_FP8, r) for r in raw]
            k, v = [r.view(torch.float8_e4m3fn) for r in raw]
            k_scale, v_scale = torch.rand(H, generator=gen) * 3 / 448, torch.rand(H, generator=gen) * 3 / 448
        else:
            k, v = [torch.randint(-128, 128, (B, H, S, D), generator=gen, dtype=torch.int8) for _ in "kv"]
            k_scale, v_scale = torch.rand(H, generator=gen) * 0.03, torch.rand(H, generator=gen) * 0.03
        store = QuantizedKV(kind=kind, k=k, v=v, k_scale=k_scale, v_scale=v_scale, length=length)
        k64 = k[:, :, :length].double() * k_scale.double()[None, :, None, None]
        v64 = v[:, :, :length].double() * v_scale.double()[None, :, None, None]
    else:
        bits = BITS[kind]
        top = (1 << bits) - 1
        kc, vc = [torch.randint(0, top + 1, (B, H, S, D), generator=gen) for _ in "kv"]
        ks = ((0.5 + torch.rand(B, H, S // G, D, generator=gen)) * 2 / top).half()
        kz = (torch.randn(B, H, S // G, D, generator=gen) - 1).half()
        vs = ((0.5 + torch.rand(B, H, S, D // G, generator=gen)) * 2 / top).half()
        vz = (torch.randn(B, H, S, D // G, generator=gen) - 1).half()
        k64 = kc.double() * ks.double().repeat_interleave(G, 2) + kz.double().repeat_interleave(G, 2)
        v64 = vc.double() * vs.double().repeat_interleave(G, 3) + vz.double().repeat_interleave(G, 3)
        k64, v64 = k64[:, :, :length], v64[:, :, :length]
        group_unread = unread.reshape(B, S // G, G).all(-1)  # key groups wholly unread
        ks = ks.masked_fill(group_unread[:, None, :, None], float("nan"))
        vs = vs.masked_fill(unread[:, None, :, None], float("nan"))
        store = QuantizedKV(kind=kind, k=pack_codes(kc, bits), v=pack_codes(vc, bits), k_scale=ks, v_scale=vs,
                            k_zero=kz, v_zero=vz, group_size=G, length=length)
    store = QuantizedKV(**{f: (getattr(store, f).to(device) if isinstance(getattr(store, f), torch.Tensor)
                               else getattr(store, f)) for f in store.__dataclass_fields__})
    return store, k64, v64


def left_padding_mask(pad, length, device="cpu"):
    return (torch.arange(length)[None, :] >= torch.tensor(pad)[:, None]).to(device)  # [B, length]


def naive_attention(q, k, v, mask, sm_scale):
    """float64 softmax(sm_scale q k^T) v per query head, with head h reading kv head h // (Hq / Hkv)."""
    B, Hq, D = q.shape
    k = k.repeat_interleave(Hq // k.shape[1], dim=1)  # [B, Hq, L, D]
    v = v.repeat_interleave(Hq // v.shape[1], dim=1)
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    lse = torch.full((B, Hq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        keep = mask[b] if mask is not None else torch.ones(k.shape[2], dtype=torch.bool)
        if keep.any():
            s = sm_scale * torch.einsum("hd,htd->ht", q[b].double(), k[b][:, keep])
            lse[b] = torch.logsumexp(s, dim=-1)
            out[b] = torch.einsum("ht,htd->hd", torch.softmax(s, dim=-1), v[b][:, keep])
    return out, lse


def assert_attention_close(out, lse, out_ref, lse_ref, atol, rtol):
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), out_ref.cpu().double(), atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu().double(), lse_ref.cpu().double(), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- layout and reference


@pytest.mark.parametrize("bits", [4, 2])
def test_unpacking_fixed_bytes(bits):
    # int4: byte 0x21 holds channel 0 = 1 (low nibble), channel 1 = 2. int2: 0b11100100 holds 0, 1, 2, 3.
    byte = 0x21 if bits == 4 else 0b11100100
    codes = [1, 2] if bits == 4 else [0, 1, 2, 3]
    D = len(codes)
    k = torch.full((1, 1, D, 1), byte, dtype=torch.uint8)  # D tokens, one byte each
    ones, zeros = torch.ones(1, 1, 1, D, dtype=torch.half), torch.zeros(1, 1, 1, D, dtype=torch.half)
    store = QuantizedKV(kind=f"int{bits}", k=k, v=k.clone(), k_scale=ones, k_zero=zeros,
                        v_scale=ones.view(1, 1, D, 1), v_zero=zeros.view(1, 1, D, 1), group_size=D, length=D)
    k_deq, v_deq = dequantize_kv(store)
    expected = torch.tensor(codes, dtype=torch.float32).expand(1, 1, D, D)
    assert torch.equal(k_deq, expected) and torch.equal(v_deq, expected)
    assert torch.equal(pack_codes(expected.long(), bits), k)


@pytest.mark.parametrize("kind", ["fp8", "int8", "int4", "int2"])
def test_reference_matches_float64_naive(kind):
    B, H, Hq, D, S, length, pad = 3, 2, 8, 32, 192, 160, [0, 37, 160]  # row 2 fully padded
    store, k64, v64 = make_store(kind, B, H, S, D, length, pad=pad)
    k_deq, v_deq = dequantize_kv(store)
    attended = left_padding_mask(pad, length)[:, None, :, None]
    # where read, the fp32 dequantization is the float64 one up to its single rounding (2^-24 relative)
    for deq, exact in ((k_deq, k64), (v_deq, v64)):
        torch.testing.assert_close(torch.where(attended, deq.double(), 0), torch.where(attended, exact, 0),
                                   atol=0, rtol=2**-23)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(1))
    mask = left_padding_mask(pad, length)
    out, lse = decode_attention_reference(q, store, mask, sm_scale=0.3)
    out_ref, lse_ref = naive_attention(q, k64, v64, mask, 0.3)
    assert_attention_close(out, lse, out_ref, lse_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and bool((lse[2] == float("-inf")).all())


# ----------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("ratio", [1, 4], ids=["mha", "gqa4"])
@pytest.mark.parametrize("kind", ["fp8", "int8", "int4", "int2"])
def test_kernel_matches_reference(kind, ratio, device):
    B, H, D, S, length = 2, 2, 64, 192, 144  # 144 = 2 * 64 + 16: the last tile is partial
    store, _, _ = make_store(kind, B, H, S, D, length, seed=ratio, device=device)
    q = torch.randn(B, H * ratio, D, generator=torch.Generator().manual_seed(2)).to(device)
    out_ref, lse_ref = decode_attention_reference(q, store)
    for splits in (1, 2, None):  # None: the default heuristic (3 splits of one tile here)
        out, lse = decode_attention(q, store, num_splits=splits)
        assert_attention_close(out, lse, out_ref, lse_ref, **KERNEL_TOL)


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_kernel_left_padding_and_empty_row(kind, device):
    B, H, Hq, D, S, length, pad = 3, 1, 4, 32, 256, 208, [0, 75, 208]  # row 2 attends nothing
    store, _, _ = make_store(kind, B, H, S, D, length, pad=pad, seed=3, device=device)
    q = torch.randn(B, Hq, D, generator=torch.Generator().manual_seed(4)).to(device)
    mask = left_padding_mask(pad, length, device)
    out_ref, lse_ref = decode_attention_reference(q, store, mask, sm_scale=0.2)
    out, lse = decode_attention(q, store, mask, sm_scale=0.2, num_splits=4)  # split 0 of row 1: all padding
    assert_attention_close(out, lse, out_ref, lse_ref, **KERNEL_TOL)
    assert torch.equal(out[2].cpu(), torch.zeros(Hq, D)) and bool((lse[2] == float("-inf")).all())


@pytest.mark.parametrize("kind,G,D,length", [
    ("int4", 32, 64, 96),    # tiles of one 32-token key group; 16 bytes per value group
    ("int2", 32, 64, 96),
    ("int4", 128, 128, 256),  # tiles of 64 tokens inside a 128-token key group
    ("int2", 64, 64, 128),
    ("int2", 16, 32, 64),     # D = 32 < 16 * 4 planes: the tile of bytes is padded and masked
    ("int4", 16, 48, 48),     # D = 48: a tile of 64 channels with the last 16 masked; 3 value groups
])
def test_kernel_kivi_group_sizes(kind, G, D, length, device):
    store, _, _ = make_store(kind, 2, 1, length + G, D, length, G=G, pad=[0, G + 5], seed=G, device=device)
    q = torch.randn(2, 2, D, generator=torch.Generator().manual_seed(6)).to(device)
    mask = left_padding_mask([0, G + 5], length, device)
    out, lse = decode_attention(q, store, mask, num_splits=2)
    assert_attention_close(out, lse, *decode_attention_reference(q, store, mask), **KERNEL_TOL)


def test_kernel_refuses_other_kivi_group_sizes(device):
    store, _, _ = make_store("int4", 1, 1, 48, 48, 48, G=12, device=device)  # a valid store, G not a power of 2
    assert not is_supported(device, "int4", 12) and not is_supported(device, "int2", 8)
    with pytest.raises(RuntimeError, match=r"powers of two >= 16; call decode_attention_reference"):
        decode_attention(torch.randn(1, 1, 48, device=device), store)
    out, _ = decode_attention_reference(torch.randn(1, 1, 48, device=device), store)
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("kind", ["int8", "int2"])
def test_length_zero(kind, device):
    store, _, _ = make_store(kind, 2, 2, 64, 32, 0, device=device)
    q = torch.randn(2, 4, 32, device=device)
    for out, lse in (decode_attention(q, store), decode_attention_reference(q, store)):
        assert torch.equal(out.cpu(), torch.zeros(2, 4, 32))
        assert torch.equal(lse.cpu(), torch.full((2, 4), float("-inf")))


# ----------------------------------------------------------------------------- merging


def test_merge_of_two_halves_equals_whole():
    gen = torch.Generator().manual_seed(7)
    B, H, Hq, L, D = 3, 2, 4, 40, 16
    q = torch.randn(B, Hq, D, generator=gen)
    k, v = torch.randn(B, H, L, D, generator=gen), torch.randn(B, H, L, D, generator=gen)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, :25] = False  # row 1: its first half is fully masked (lse -inf there)
    mask[2] = False  # row 2: both halves empty
    whole = attention_reference_dense(q, k, v, mask)
    first = attention_reference_dense(q, k[:, :, :20], v[:, :, :20], mask[:, :20])
    second = attention_reference_dense(q, k[:, :, 20:], v[:, :, 20:], mask[:, 20:])
    assert bool((first[1][1] == float("-inf")).all())
    out, lse = merge_attention(*first, *second)
    assert_attention_close(out, lse, *whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros(Hq, D)) and bool((lse[2] == float("-inf")).all())
    out, lse = merge_attention(*second, *first)  # symmetric
    assert_attention_close(out, lse, *whole, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- errors and support


def test_store_errors_name_the_problem():
    store, _, _ = make_store("int4", 1, 2, 64, 32, 32)
    fields = {f: getattr(store, f) for f in store.__dataclass_fields__}
    with pytest.raises(ValueError, match=r"kind 'int3' is not supported"):
        QuantizedKV(**{**fields, "kind": "int3"})
    with pytest.raises(ValueError, match=r"length=24 must be a multiple of group_size=16"):
        QuantizedKV(**{**fields, "length": 24})
    with pytest.raises(ValueError, match=r"length=80 must lie in \[0, S=64\]"):
        QuantizedKV(**{**fields, "length": 80})
    with pytest.raises(ValueError, match=r"k_scale must be \[1, 2, 4, 32\]"):
        QuantizedKV(**{**fields, "k_scale": store.k_scale[:, :, :2]})
    with pytest.raises(ValueError, match=r"k and v must be torch.uint8"):
        QuantizedKV(**{**fields, "k": store.k.view(torch.int8)})
    with pytest.raises(ValueError, match=r"group_size must be a positive int dividing"):
        QuantizedKV(**{**fields, "group_size": 24})
    with pytest.raises(ValueError, match=r"v_zero must be float16"):
        QuantizedKV(**{**fields, "v_zero": store.v_zero.float()})
    q = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match=r"q must be \[B=1, Hq, D=32\] with Hq a multiple of Hkv=2"):
        decode_attention_reference(q, store)
    with pytest.raises(ValueError, match=r"key_mask must be a bool tensor \[B=1, length=32\]"):
        decode_attention_reference(torch.randn(1, 4, 32), store, torch.ones(1, 31, dtype=torch.bool))


def test_support_and_cpu_without_interpreter(monkeypatch):
    assert is_supported("cuda" if torch.cuda.is_available() else "cpu", "int4")
    with pytest.raises(ValueError, match=r"kind 'int3'"):
        is_supported("cpu", "int3")
    monkeypatch.setattr(kv_attention, "_INTERPRET", False)
    assert not is_supported("cpu", "fp8")
    store, _, _ = make_store("int8", 1, 1, 64, 32, 64)
    with pytest.raises(RuntimeError, match=r"call decode_attention_reference"):
        decode_attention(torch.randn(1, 1, 32), store)


def test_default_split_count():
    assert kv_attention.default_num_splits(1, 1, 10, "cpu") == 1  # one tile: one split
    assert 1 < kv_attention.default_num_splits(1, 1, 64 * 10, "cpu") <= 10
    assert kv_attention.default_num_splits(1, 1, 64 * 1000, "cpu") <= kv_attention.MAX_SPLITS
    assert kv_attention.default_num_splits(64, 8, 0, "cpu") == 1  # length 0
