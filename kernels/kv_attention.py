"""Decode attention over a quantized KV cache (flash-decoding): one query token per sequence.

What it computes
    q [B, Hq, D], a quantized K/V store holding `length` tokens per sequence, key_mask [B, length]
    (True = attend; False for left padding) or None, sm_scale (default 1 / sqrt(D)):
        s[b, h, t] = sm_scale * q[b, h] . k[b, h // (Hq / Hkv), t]      over attended t
        lse[b, h]  = log sum_t exp(s[b, h, t])                          natural log, float32
        out[b, h]  = sum_t exp(s[b, h, t] - lse[b, h]) v[b, h // (Hq / Hkv), t]      float32
    A row with no attended key gives out = 0 and lse = -inf. merge_attention combines two such
    (out, lse) pairs over disjoint key sets (the quantized store and the cache's 16-bit residual
    window of newest tokens, for which attention_reference_dense computes the pair).

Data layout it reads: kv_layout.QuantizedKV (fp8/int8 codes with per-head scales; KIVI
    int4/int2 codes packed along head_dim with float16 scales and zero points per group).

How the kernels run
    Split kernel, grid (splits, Hkv, B): each program streams its share of the tokens of one
    (sequence, kv head) in tiles of BLOCK_N tokens and serves all Hq / Hkv query heads of the GQA
    group at once (padded to 16 rows for tl.dot), so the cache bytes are read once. It loads the
    quantized bytes and dequantizes in registers; tl.dot takes fp16 operands and accumulates in fp32;
    the softmax is online (running max and sum, base 2).
      fp8 / int8  codes become fp16 exactly (e4m3 by a cast; int8 without a conversion instruction:
                  the bits 0x6400 + code + 128 are the fp16 number 1152 + code); k_scale multiplies
                  the scores and v_scale the output.
      int4 / int2 the kernel works per bit plane J (the channels (8 / b) * i + J, bits J * b of byte
                  i): a [BLOCK_N, D * b / 8] tile of bytes gives each plane with a shift and a mask,
                  the code becomes fp16 as the bits 0x6400 | code minus 1024, then code * scale + zero
                  in fp16. q and the output are read and written plane by plane, so nothing is
                  reshaped. BLOCK_N = min(64, G) keeps a tile inside one key group (one row of key
                  scales per tile), hence G must be a power of two >= 16 for the kernel.
    Each program writes its normalized partial output and log-sum-exp; a combine kernel (grid
    B * Hq) merges the splits by log-sum-exp. With one split the partials are the result. The
    number of splits grows until the programs fill the GPU about four times over (at most
    MAX_SPLITS, at least one tile each).

Where it runs
    CUDA GPUs; "fp8" needs compute capability >= 8.9 (Ada, Hopper): is_supported(device, kind,
    group_size) says whether the kernel can run a store. Under TRITON_INTERPRET=1 the interpreter
    runs the kernels on CPU tensors. Elsewhere decode_attention raises; decode_attention_reference
    runs anywhere (dequantize, then fp32).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from .kv_layout import KINDS, STATIC_DTYPES, QuantizedKV, dequantize_kv  # noqa: F401 (re-exported)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BLOCK_N = 64  # tokens per tile
MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


def is_supported(device, kind: str, group_size: int | None = None) -> bool:
    """True when decode_attention can run a store of `kind` (and KIVI `group_size`, if given) on `device`.

    fp8 needs compute capability >= 8.9; KIVI group sizes must be powers of two >= 16 (a tile of
    tokens lies in one key group and feeds tl.dot, which needs >= 16 rows).
    """
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not supported; expected one of {sorted(KINDS)}")
    if kind not in STATIC_DTYPES and group_size is not None and (group_size < 16 or group_size & (group_size - 1)):
        return False
    if _INTERPRET:
        return True
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return kind != "fp8" or torch.cuda.get_device_capability(device) >= (8, 9)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _token_range(split, blocks_per_split, length, BLOCK_N: tl.constexpr):
    """[start, end) of this split's tokens; start is a multiple of BLOCK_N."""
    start = split * blocks_per_split * BLOCK_N
    return start, tl.minimum(start + blocks_per_split * BLOCK_N, length)


@triton.jit
def _valid_tokens(offs_n, end, mask_row, HAS_MASK: tl.constexpr):
    """[BLOCK_N] True where a token exists (< end) and key_mask lets it be attended."""
    valid = offs_n < end
    if HAS_MASK:
        valid = valid & (tl.load(mask_row + offs_n, mask=valid, other=0) != 0)
    return valid


@triton.jit
def _softmax_step(scores, valid, m_i, l_i):
    """Online softmax over one tile of base-2 scores [BH, BN]: (p, alpha, m_new, l_new)."""
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing attended yet: avoid -inf - -inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])  # [BH, BN], 0 at masked tokens
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _finish_rows(m_i, l_i, pl_row, heads, h_mask):
    """Store each query head's natural-log lse (-inf when nothing was attended); return 1 / l (0 then)."""
    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(pl_row + heads, lse, mask=h_mask)
    return tl.where(seen, 1.0 / l_safe, 0.0)


@triton.jit
def _int8_to_fp16(x):
    """int8 -> exact fp16 without a conversion instruction: the bits 0x6400 + (x + 128) are 1024 + x + 128."""
    return (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0


@triton.jit(do_not_specialize=["length", "blocks_per_split"])  # both change every decode step
def _static_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, mask_ptr, po_ptr, pl_ptr, length, blocks_per_split, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_mb, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    D: tl.constexpr, RATIO: tl.constexpr, IS_INT8: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """fp8 / int8 with per-head scales: codes -> fp16 exactly; k_scale scales the scores, v_scale the output."""
    split, kh, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)  # query heads of this GQA group (rows >= RATIO are padding)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kh * RATIO + offs_h
    h_mask, d_mask = offs_h < RATIO, offs_d < D
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float16)  # [BH, BD]
    k_base = k_ptr + b * stride_kb + kh * stride_kh
    v_base = v_ptr + b * stride_vb + kh * stride_vh
    qk_scale = qk_scale * tl.load(ks_ptr + kh)  # base-2 scores: sm_scale * log2(e) * k_scale

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)  # running max of base-2 scores
    l_i = tl.zeros((BLOCK_H,), tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    start, end = _token_range(split, blocks_per_split, length, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] token positions
        valid = _valid_tokens(offs_n, end, mask_ptr + b * stride_mb, HAS_MASK)
        tile_mask = valid[:, None] & d_mask[None, :]  # masked tokens load as 0: padding may hold NaN bytes
        # `other` is 0.0: the interpreter cannot cast an int 0 to fp8
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_d[None, :], mask=tile_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=tile_mask, other=0.0)
        if IS_INT8:
            k, v = _int8_to_fp16(k), _int8_to_fp16(v)
        else:
            k, v = k.to(tl.float16), v.to(tl.float16)  # e4m3 -> fp16 is exact
        scores = tl.dot(q, tl.trans(k)) * qk_scale  # [BH, BN]
        p, alpha, m_i, l_i = _softmax_step(scores, valid, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)

    inv_l = _finish_rows(m_i, l_i, pl_ptr + b * stride_plb + split, heads * stride_plh, h_mask)
    out = acc * (inv_l * tl.load(vs_ptr + kh))[:, None]
    tl.store(po_ptr + b * stride_pob + split * stride_pos + heads[:, None] * stride_poh + offs_d[None, :], out,
             mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def _code_plane(packed, J: tl.constexpr, BITS: tl.constexpr):
    """Bit plane J of int16-widened bytes (the code of channel (8 / BITS) * i + J of byte i) as exact fp16:
    the bits 0x6400 | code are the fp16 number 1024 + code (no int -> float conversion instruction)."""
    code = (packed >> (J * BITS)) & ((1 << BITS) - 1)
    return (code | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _split_planes(row, BLOCK_D: tl.constexpr, PER: tl.constexpr):
    """A [BLOCK_D] row over channels -> its PER bit-plane rows [BLOCK_D / PER] (channel PER * i + J)."""
    if PER == 2:
        p0, p1 = tl.split(tl.reshape(row, (BLOCK_D // 2, 2)))
        return p0, p1, p0, p1
    else:
        even, odd = tl.split(tl.reshape(row, (BLOCK_D // 4, 2, 2)))  # [i, J // 2] for J % 2 = 0, 1
        p0, p2 = tl.split(even)
        p1, p3 = tl.split(odd)
        return p0, p1, p2, p3


@triton.jit
def _key_plane(kbytes, q_j, s_j, z_j, J: tl.constexpr, BITS: tl.constexpr):
    """Scores [BH, BN] from the channels of bit plane J; the tile's tokens share one key group."""
    k = _code_plane(kbytes, J, BITS) * s_j[None, :] + z_j[None, :]  # [BN, BD / PER] fp16
    return tl.dot(q_j, tl.trans(k))


@triton.jit
def _value_plane(vbytes, s, z, p, acc_j, alpha, J: tl.constexpr, BITS: tl.constexpr):
    """acc_j [BH, BD / PER] (output channels PER * i + J) rescaled by alpha, plus p @ values of plane J."""
    v = _code_plane(vbytes, J, BITS) * s + z  # [BN, BD / PER] fp16
    return acc_j * alpha[:, None] + tl.dot(p, v)


@triton.jit(do_not_specialize=["length", "blocks_per_split"])  # both change every decode step
def _kivi_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, mask_ptr, po_ptr, pl_ptr, length, blocks_per_split, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ksb, stride_ksh, stride_ksg, stride_kzb, stride_kzh, stride_kzg,
    stride_vsb, stride_vsh, stride_vst, stride_vzb, stride_vzh, stride_vzt,
    stride_mb, stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    D: tl.constexpr, RATIO: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """int4 / int2 (KIVI), computed per bit plane J = the channels PER * i + J (bits J * BITS of byte i), so
    that a [BN, D / PER] tile of bytes is split with a shift and a mask, never reshaped:
        scores = sum_J q[:, plane J] @ k[:, plane J]^T,    out[:, plane J] = p @ v[:, plane J]
    A tile of BLOCK_N <= GROUP tokens lies in one key group: one row of key scales and zeros per tile."""
    PER: tl.constexpr = 8 // BITS
    split, kh, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    heads = kh * RATIO + offs_h
    h_mask = offs_h < RATIO
    offs_i = tl.arange(0, BLOCK_D // PER)  # byte within a token's row = column of every plane
    i_mask = offs_i < D // PER
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_i[None, :] * PER
    q_mask = h_mask[:, None] & i_mask[None, :]
    q0 = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float16)  # [BH, BD / PER], plane 0
    q1 = tl.load(q_ptrs + 1, mask=q_mask, other=0.0).to(tl.float16)
    if PER == 4:
        q2 = tl.load(q_ptrs + 2, mask=q_mask, other=0.0).to(tl.float16)
        q3 = tl.load(q_ptrs + 3, mask=q_mask, other=0.0).to(tl.float16)
    k_base = k_ptr + b * stride_kb + kh * stride_kh
    v_base = v_ptr + b * stride_vb + kh * stride_vh
    ks_base = ks_ptr + b * stride_ksb + kh * stride_ksh
    kz_base = kz_ptr + b * stride_kzb + kh * stride_kzh
    vs_base = vs_ptr + b * stride_vsb + kh * stride_vsh
    vz_base = vz_ptr + b * stride_vzb + kh * stride_vzh

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, BLOCK_D // PER), tl.float32)  # output channels of plane 0
    acc1 = tl.zeros((BLOCK_H, BLOCK_D // PER), tl.float32)
    acc2 = tl.zeros((BLOCK_H, BLOCK_D // PER), tl.float32)  # planes 2 and 3: int2 only
    acc3 = tl.zeros((BLOCK_H, BLOCK_D // PER), tl.float32)
    start, end = _token_range(split, blocks_per_split, length, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = _valid_tokens(offs_n, end, mask_ptr + b * stride_mb, HAS_MASK)
        tile_mask = valid[:, None] & i_mask[None, :]  # invalid tokens load 0 codes, scales and zeros
        kbytes = tl.load(k_base + offs_n[:, None] * stride_kt + offs_i[None, :], mask=tile_mask, other=0)
        ks = tl.load(ks_base + (n0 // GROUP) * stride_ksg + offs_d, mask=offs_d < D, other=0.0)  # [BD]
        kz = tl.load(kz_base + (n0 // GROUP) * stride_kzg + offs_d, mask=offs_d < D, other=0.0)
        s0, s1, s2, s3 = _split_planes(ks, BLOCK_D, PER)
        z0, z1, z2, z3 = _split_planes(kz, BLOCK_D, PER)
        kbytes = kbytes.to(tl.int16)  # [BN, BD / PER]
        scores = _key_plane(kbytes, q0, s0, z0, 0, BITS) + _key_plane(kbytes, q1, s1, z1, 1, BITS)
        if PER == 4:
            scores += _key_plane(kbytes, q2, s2, z2, 2, BITS) + _key_plane(kbytes, q3, s3, z3, 3, BITS)
        p, alpha, m_i, l_i = _softmax_step(scores * qk_scale, valid, m_i, l_i)

        vbytes = tl.load(v_base + offs_n[:, None] * stride_vt + offs_i[None, :], mask=tile_mask, other=0)
        group = (offs_i // (GROUP // PER))[None, :]  # value group of each byte (all its channels)
        s = tl.load(vs_base + offs_n[:, None] * stride_vst + group, mask=tile_mask, other=0.0)  # [BN, BD / PER]
        z = tl.load(vz_base + offs_n[:, None] * stride_vzt + group, mask=tile_mask, other=0.0)
        vbytes = vbytes.to(tl.int16)
        p = p.to(tl.float16)
        acc0 = _value_plane(vbytes, s, z, p, acc0, alpha, 0, BITS)
        acc1 = _value_plane(vbytes, s, z, p, acc1, alpha, 1, BITS)
        if PER == 4:
            acc2 = _value_plane(vbytes, s, z, p, acc2, alpha, 2, BITS)
            acc3 = _value_plane(vbytes, s, z, p, acc3, alpha, 3, BITS)

    inv_l = _finish_rows(m_i, l_i, pl_ptr + b * stride_plb + split, heads * stride_plh, h_mask)[:, None]
    po_ptrs = po_ptr + b * stride_pob + split * stride_pos + heads[:, None] * stride_poh + offs_i[None, :] * PER
    tl.store(po_ptrs, acc0 * inv_l, mask=q_mask)
    tl.store(po_ptrs + 1, acc1 * inv_l, mask=q_mask)
    if PER == 4:
        tl.store(po_ptrs + 2, acc2 * inv_l, mask=q_mask)
        tl.store(po_ptrs + 3, acc3 * inv_l, mask=q_mask)


@triton.jit
def _combine_kernel(po_ptr, pl_ptr, out_ptr, lse_ptr, splits, HQ,
                    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh, stride_lb,
                    D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (sequence, query head): merge the splits' (out, lse) by log-sum-exp."""
    row = tl.program_id(0)
    b = row // HQ
    h = row % HQ
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < splits
    lse_s = tl.load(pl_ptr + b * stride_plb + h * stride_plh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse_s, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_safe)  # [BS], 0 for splits that attended nothing
    total = tl.sum(w, axis=0)
    po_ptrs = po_ptr + b * stride_pob + h * stride_poh + offs_s[:, None] * stride_pos + offs_d[None, :]
    parts = tl.load(po_ptrs, mask=s_mask[:, None] & (offs_d < D)[None, :], other=0.0)  # [BS, BD]
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    lse = tl.where(total > 0.0, m_safe + tl.log(tl.where(total > 0.0, total, 1.0)), float("-inf"))
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out, mask=offs_d < D)
    tl.store(lse_ptr + b * stride_lb + h, lse)


# ----------------------------------------------------------------------------- wrapper


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so that the combine step always runs in tests
    return torch.cuda.get_device_properties(device).multi_processor_count


def block_tokens(kind: str, group_size: int | None = None) -> int:
    """Tokens per tile of the split kernel: BLOCK_N, or one key group for KIVI groups below it."""
    return BLOCK_N if kind in STATIC_DTYPES else min(BLOCK_N, group_size)


def default_num_splits(batch: int, kv_heads: int, length: int, device, block_n: int = BLOCK_N) -> int:
    """Splits per (sequence, kv head): enough programs to fill the GPU ~4 times, one tile at least."""
    blocks = triton.cdiv(length, block_n)
    wanted = triton.cdiv(4 * _multiprocessors(torch.device(device)), max(1, batch * kv_heads))
    return max(1, min(wanted, blocks, MAX_SPLITS))


def _check_query(q, store, key_mask, sm_scale):
    """Validate q and key_mask against the store; return sm_scale (default 1 / sqrt(D))."""
    store.check()
    B, H = store.k.shape[:2]
    D = store.head_dim
    if q.dim() != 3 or q.shape[0] != B or q.shape[2] != D or q.shape[1] % H:
        raise ValueError(f"q must be [B={B}, Hq, D={D}] with Hq a multiple of Hkv={H}; got {list(q.shape)}")
    if not q.is_floating_point():
        raise ValueError(f"q must be a float tensor, got {q.dtype}")
    if key_mask is not None and (key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, store.length)):
        raise ValueError(f"key_mask must be a bool tensor [B={B}, length={store.length}] or None; got "
                         f"{key_mask.dtype} {list(key_mask.shape)}")
    return 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)


def _launch_split(q, s: QuantizedKV, mask, part_out, part_lse, per_split, sm_scale, block_n):
    """Run the split kernel of the store's kind over grid (splits, Hkv, B)."""
    B, Hq, D = q.shape
    H = s.k.shape[1]
    grid = (part_out.shape[2], H, B)
    common = dict(D=D, RATIO=Hq // H, HAS_MASK=mask is not None, BLOCK_H=max(16, triton.next_power_of_2(Hq // H)),
                  BLOCK_N=block_n, num_warps=4 if D <= 128 else 8, num_stages=2)  # 8 warps: no spills at D = 256
    mask = mask if mask is not None else q  # placeholder pointer: the kernel does not read it
    tail = (mask.stride(0) if mask.dim() == 2 else 0, *part_out.stride()[:3], *part_lse.stride()[:2])
    qk_scale = sm_scale * _LOG2E  # the kernels score in base 2
    if s.static:
        _static_split_kernel[grid](
            q, s.k, s.v, s.k_scale, s.v_scale, mask, part_out, part_lse, s.length, per_split, qk_scale,
            *q.stride()[:2], *s.k.stride()[:3], *s.v.stride()[:3], *tail,
            IS_INT8=s.kind == "int8", BLOCK_D=max(16, triton.next_power_of_2(D)), **common)
    else:
        per_byte = 8 // s.bits
        _kivi_split_kernel[grid](
            q, s.k, s.v, s.k_scale, s.k_zero, s.v_scale, s.v_zero, mask, part_out, part_lse, s.length, per_split,
            qk_scale, *q.stride()[:2], *s.k.stride()[:3], *s.v.stride()[:3], *s.k_scale.stride()[:3],
            *s.k_zero.stride()[:3], *s.v_scale.stride()[:3], *s.v_zero.stride()[:3], *tail,
            BITS=s.bits, GROUP=s.group_size, BLOCK_D=max(16 * per_byte, triton.next_power_of_2(D)), **common)


def decode_attention(q, store: QuantizedKV, key_mask=None, sm_scale=None, *, num_splits=None):
    """(out float32 [B, Hq, D], lse float32 [B, Hq]) of q over the store's first `length` tokens.

    num_splits: programs per (sequence, kv head) along the tokens; default default_num_splits.
    """
    sm_scale = _check_query(q, store, key_mask, sm_scale)
    if not is_supported(q.device, store.kind, store.group_size):
        raise RuntimeError(f"decode_attention cannot run a {store.kind!r} store (group_size {store.group_size}) on "
                           f"{q.device}: it needs a CUDA GPU (compute capability >= 8.9 for fp8) or "
                           f"TRITON_INTERPRET=1 set before importing ptq.kernels, and KIVI group sizes that are "
                           f"powers of two >= 16; call decode_attention_reference instead")
    B, Hq, D = q.shape
    out = torch.zeros(B, Hq, D, device=q.device, dtype=torch.float32)
    lse = torch.full((B, Hq), float("-inf"), device=q.device, dtype=torch.float32)
    if store.length == 0 or B == 0:
        return out, lse
    block_n = block_tokens(store.kind, store.group_size)
    blocks = triton.cdiv(store.length, block_n)
    splits = num_splits or default_num_splits(B, store.k.shape[1], store.length, q.device, block_n)
    per_split = triton.cdiv(blocks, max(1, min(splits, blocks)))
    splits = triton.cdiv(blocks, per_split)  # every split holds at least one tile
    part_out = out[:, :, None, :] if splits == 1 else q.new_empty(B, Hq, splits, D, dtype=torch.float32)
    part_lse = lse[:, :, None] if splits == 1 else q.new_empty(B, Hq, splits, dtype=torch.float32)
    q = q if q.stride(-1) == 1 else q.contiguous()
    mask = key_mask.view(torch.uint8) if key_mask is not None else None
    if mask is not None and mask.stride(-1) != 1:
        mask = mask.contiguous()
    _launch_split(q, store, mask, part_out, part_lse, per_split, sm_scale, block_n)
    if splits > 1:
        _combine_kernel[(B * Hq,)](
            part_out, part_lse, out, lse, splits, Hq, *part_out.stride()[:3], *part_lse.stride()[:2],
            *out.stride()[:2], lse.stride(0),
            D=D, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(D), num_warps=4,
        )
    return out, lse


# ----------------------------------------------------------------------------- reference


def attention_reference_dense(q, k, v, key_mask=None, sm_scale=None):
    """(out float32 [B, Hq, D], lse float32 [B, Hq]) of q [B, Hq, D] over float k, v [B, Hkv, L, D].

    Query head h reads kv head h // (Hq / Hkv); key_mask bool [B, L] (True = attend) or None.
    A row with no attended key gives out 0 and lse -inf.
    """
    B, Hq, D = q.shape
    H, L = k.shape[1], k.shape[2]
    if k.shape != (B, H, L, D) or v.shape != k.shape or Hq % max(H, 1):
        raise ValueError(f"k and v must be [B={B}, Hkv, L, D={D}] with Hq={Hq} a multiple of Hkv; "
                         f"got {list(k.shape)} and {list(v.shape)}")
    if key_mask is not None and tuple(key_mask.shape) != (B, L):
        raise ValueError(f"key_mask must be [B={B}, L={L}] or None; got {list(key_mask.shape)}")
    sm_scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    q4 = q.float().reshape(B, H, Hq // H, D)  # [B, Hkv, ratio, D]
    scores = sm_scale * (q4 @ k.float().transpose(-1, -2))  # [B, Hkv, ratio, L]
    v = v.float()
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        v = v.masked_fill(~key_mask[:, None, :, None], 0.0)  # padding may hold NaN: 0 * NaN is NaN
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, ratio]
    p = torch.exp(scores - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])  # all 0 in empty rows
    out = p @ v  # [B, Hkv, ratio, D]
    return out.reshape(B, Hq, D), lse.reshape(B, Hq)


def decode_attention_reference(q, store: QuantizedKV, key_mask=None, sm_scale=None):
    """decode_attention in plain torch: dequantize_kv, then attention_reference_dense in fp32."""
    sm_scale = _check_query(q, store, key_mask, sm_scale)
    k, v = dequantize_kv(store)
    return attention_reference_dense(q, k, v, key_mask, sm_scale)


def merge_attention(out_a, lse_a, out_b, lse_b):
    """(out, lse) over the union of two disjoint key sets from each set's (out [..., D], lse [...])."""
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    lse_safe = torch.where(torch.isneginf(lse), 0.0, lse)  # both empty: weights exp(-inf) = 0
    w_a = torch.exp(lse_a.float() - lse_safe)[..., None]
    w_b = torch.exp(lse_b.float() - lse_safe)[..., None]
    return w_a * out_a.float() + w_b * out_b.float(), lse
