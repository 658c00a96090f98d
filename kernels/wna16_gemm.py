"""Weight-only integer GEMM (W4A16, W8A16; also 2- and 3-bit): y = x @ dequant(W)^T + bias.

What it computes
    x: [M, K] activations in fp16 / bf16 / fp32 (any leading shape [..., K] is flattened).
    W: [N, K] int weights stored packed; dequantized inside the kernel, tile by tile:
        w[n, k] = (q[n, k] - z[n, g]) * s[n, g],   g = k // group_size   (or g_idx[k])
    The dequantized tile is rounded to x's dtype (like the reference), multiplied with
    tl.dot, accumulated in fp32; bias is added in fp32; y is cast to x's dtype.

Data layout it reads (the compressed-tensors "pack-quantized" checkpoint, AS IS)
    weight_packed      int32 [N, ceil(K * bits / 32)]. Each signed q in [-2^(b-1), 2^(b-1)-1]
                       is stored as q + 2^(b-1) (int4 -> 0..15) in a dense little-endian bit
                       stream per row: element k starts at bit k * bits, word = bit // 32.
                       4 bits: word k // 8, bit 4 * (k % 8); 8 bits: word k // 4, bit 8 * (k % 4).
                       3 bits: an element may straddle two words.
    weight_scale       [N, n_groups] in any float dtype, n_groups = ceil(K / group_size);
                       [N, 1] for per-channel (group_size None).
    weight_zero_point  None (symmetric) or int8 / int32 [N, n_groups], UNPACKED, signed values
                       in the same range as q (ptq unpacks the checkpoint's zero points once).
    g_idx              None or int32 [K]: group of each input column (activation reordering).

Layout decision: no repack. The kernel reads the checkpoint tensors as they are, so a
QuantLinear holds exactly what it loaded and saved. For bits in {2, 4, 8} a tile loads the
BLOCK_K * bits / 32 consecutive words of each of its rows once and splits them with shifts
and a reshape (no redundant loads); for 3 bits it loads the one or two words holding each
element (a gather, served from L1). Words run along K, so one row's tile is a short
contiguous run (64 bytes for int4 and BLOCK_K = 128), not a wide coalesced row as in
GPTQ's [K / 8, N] layout; whether a repack to [K / 8, N] pays on Hopper is measured later.

K needs to be a multiple of nothing: loads past K are masked, so ragged K (and a last group
shorter than group_size) work. The wrapper checks that the shapes agree with each other.

Two launch shapes of the same kernel
    decode  (M <= 16): BLOCK_M = 16 and split-K: SPLIT_K programs share the K loop of one
            output tile and add their fp32 partial sums into a zeroed fp32 buffer with
            atomics (summation order, hence the last bits, may vary run to run).
    prefill (M > 16):  classic tiles with grouped ("swizzled") tile order for L2 reuse.
On CUDA both are autotuned over Hopper-sized configs, keyed by (next power of two of M, N, K);
PTQ_KERNEL_AUTOTUNE=0 (read at import) keeps only the first, default config of each list (the
GPU tests use it: tuning every test shape would compile hundreds of variants). Under
TRITON_INTERPRET=1 each uses one small config (autotuning the interpreter is too slow).
On a CPU tensor without the interpreter the wrapper raises; use wna16_matmul_reference.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from .tiles import grouped_tile

SUPPORTED_BITS = (2, 3, 4, 8)
SMALL_M = 16  # M at or below this takes the decode (split-K) launch
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_AUTOTUNE = os.environ.get("PTQ_KERNEL_AUTOTUNE", "1") != "0"


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _unpack_aligned(w_ptr, k0, offs_n, n_mask, stride_wn, K_WORDS,
                    BITS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """32 % BITS == 0: the tile's values of row n fill BLOCK_K * BITS / 32 whole words."""
    PER_WORD: tl.constexpr = 32 // BITS
    offs_w = k0 // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)  # [BK / PER_WORD]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_w[:, None]
    words = tl.load(w_ptrs, mask=n_mask[None, :] & (offs_w[:, None] < K_WORDS), other=0)
    shifts = tl.arange(0, PER_WORD) * BITS  # [PER_WORD], least significant bits first
    # Arithmetic shift is fine here: the mask drops the sign bits it drags in.
    q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)  # [BK/PER, PER, BN]
    return tl.reshape(q, (BLOCK_K, BLOCK_N))  # row k = word * PER_WORD + position


@triton.jit
def _unpack_straddling(w_ptr, offs_k, k_mask, offs_n, n_mask, stride_wn, BITS: tl.constexpr):
    """Any BITS: element k starts at bit k * BITS and may run into the next word."""
    start = offs_k * BITS  # [BK]
    word = start // 32
    shift = (start % 32).to(tl.uint32)
    spills = (start % 32 + BITS) > 32  # [BK]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + word[:, None]
    mask = k_mask[:, None] & n_mask[None, :]
    lo = tl.load(w_ptrs, mask=mask, other=0).to(tl.uint32, bitcast=True)  # [BK, BN]
    hi = tl.load(w_ptrs + 1, mask=mask & spills[:, None], other=0).to(tl.uint32, bitcast=True)
    # Logical shifts on uint32; hi is 0 where nothing spills, and (32 - shift) % 32 < 32.
    q = (lo >> shift[:, None]) | (hi << ((32 - shift[:, None]) % 32))
    return (q & ((1 << BITS) - 1)).to(tl.int32)


@triton.jit
def _dequant_tile(w_ptr, s_ptr, z_ptr, g_ptr, k0, offs_n, N, K, K_WORDS,
                  stride_wn, stride_sn, stride_sg, stride_zn, stride_zg,
                  BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr,
                  HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  OUT_DTYPE: tl.constexpr):
    """Dequantized tile W^T[k0:k0+BLOCK_K, offs_n] -> [BLOCK_K, BLOCK_N] in OUT_DTYPE."""
    offs_k = k0 + tl.arange(0, BLOCK_K)  # [BK]
    k_mask = offs_k < K
    n_mask = offs_n < N
    if 32 % BITS == 0:
        q = _unpack_aligned(w_ptr, k0, offs_n, n_mask, stride_wn, K_WORDS, BITS, BLOCK_K, BLOCK_N)
    else:
        q = _unpack_straddling(w_ptr, offs_k, k_mask, offs_n, n_mask, stride_wn, BITS)
    q = q - (1 << (BITS - 1))  # stored offset -> signed value, [BK, BN]

    if (not HAS_G_IDX) and (GROUP_SIZE % BLOCK_K == 0):
        # The whole tile lies in one group: one scale (and zero) per output column.
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_mask, other=0.0)[None, :]
        if HAS_ZP:
            z = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=n_mask, other=0)[None, :]
    else:
        # Groups change inside the tile (small groups or act-order): gather per element.
        if HAS_G_IDX:
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)  # [BK]
        else:
            g = offs_k // GROUP_SIZE
        mask = k_mask[:, None] & n_mask[None, :]
        s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g[:, None] * stride_sg, mask=mask, other=0.0)
        if HAS_ZP:
            z = tl.load(z_ptr + offs_n[None, :] * stride_zn + g[:, None] * stride_zg, mask=mask, other=0)
    if HAS_ZP:
        q = q - z.to(tl.int32)
    return (q.to(tl.float32) * s.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def _wna16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, b_ptr, y_ptr,
    M, N, K, K_WORDS,
    M_BUCKET,  # autotune key only (next power of two of M); the kernel does not read it
    stride_xm, stride_xk, stride_wn, stride_sn, stride_sg, stride_zn, stride_zg, stride_ym, stride_yn,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_ZP: tl.constexpr, HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # This program takes K tiles pid_k, pid_k + SPLIT_K, ... (all of them when SPLIT_K == 1).
    for t in range(pid_k, tl.cdiv(K, BLOCK_K), SPLIT_K):
        k0 = t * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
        x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
        w = _dequant_tile(w_ptr, s_ptr, z_ptr, g_ptr, k0, offs_n, N, K, K_WORDS,
                          stride_wn, stride_sn, stride_sg, stride_zn, stride_zg,
                          BITS, GROUP_SIZE, HAS_ZP, HAS_G_IDX, BLOCK_K, BLOCK_N,
                          x_ptr.dtype.element_ty)  # [BK, BN]
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=DOT_PRECISION)

    n_mask = offs_n < N
    if HAS_BIAS:  # added once: by the first K split
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)  # [BN]
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)  # y is a zeroed fp32 buffer


# ----------------------------------------------------------------------------- launch configs


def _config(bm, bn, bk, group_m, split_k, stages, warps):
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m, "SPLIT_K": split_k}
    return triton.Config(meta, num_stages=stages, num_warps=warps)


def _decode_configs():
    if _INTERPRET:
        return [_config(16, 32, 64, 1, 2, 1, 1)]
    # Hopper (H100 / H200): weight streaming dominates; split K so that N / BLOCK_N * SPLIT_K
    # programs fill the 132 SMs. The first entry is the default when autotuning is off.
    shapes = [(64, 128, 4, 4), (128, 128, 1, 4), (64, 128, 1, 4), (64, 256, 2, 3), (128, 128, 4, 4),
              (64, 128, 8, 4), (32, 128, 8, 4)]
    configs = [_config(16, bn, bk, 1, sk, st, 4) for bn, bk, sk, st in shapes]
    return configs if _AUTOTUNE else configs[:1]


def _prefill_configs():
    if _INTERPRET:
        return [_config(16, 32, 64, 2, 1, 1, 1)]
    shapes = [(128, 128, 64, 4, 8), (128, 256, 64, 3, 8), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4),
              (64, 64, 128, 4, 4), (32, 128, 128, 4, 4), (32, 64, 128, 4, 4)]
    configs = [_config(bm, bn, bk, 8, 1, st, w) for bm, bn, bk, st, w in shapes]
    return configs if _AUTOTUNE else configs[:1]


def _quick_bench(fn, quantiles):
    """Autotuning timer: shorter than do_bench's defaults (25 ms warm-up, 100 ms) to tune faster."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _prune_tall_tiles(configs, named_args, **kwargs):
    """Skip configs whose BLOCK_M is far taller than M (they only waste tuning time)."""
    m_bucket = named_args["M_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(32, m_bucket)]
    return kept or configs[:1]


_KEY = ["M_BUCKET", "N", "K"]

# Pipelining keeps num_stages copies of a K step's tiles in shared memory. Where groups change
# inside a tile (group_size < BLOCK_K, or act-order), the scales (and zero points) are gathered
# per element, a [BLOCK_K, BLOCK_N] tile each; with fp32 x on top, the default 4 stages need
# up to 450 KB against the H200's 227 KB (seen on the first GPU run: OutOfResources at launch).
# The wrapper then launches the same configs with fewer stages, and remembers which fitted.
_STAGE_CAPS = (None, 2, 1)  # None: the configs as listed
_launchers: dict[tuple[bool, int | None], object] = {}
_stage_cap: dict[tuple, int | None] = {}  # the kernel's specialisation -> the cap that fitted


def _launcher(decode: bool, cap: int | None):
    """The autotuned decode or prefill launcher, each config's num_stages at most cap."""
    key = (decode, cap)
    if key not in _launchers:
        configs = _decode_configs() if decode else _prefill_configs()
        if cap is not None:
            configs = [triton.Config(c.kwargs, num_stages=min(c.num_stages, cap), num_warps=c.num_warps)
                       for c in configs]
        if decode:  # split-K adds into y: each timed config starts from zeros
            tuned = triton.autotune(configs, key=_KEY, reset_to_zero=["y_ptr"], do_bench=_quick_bench)
        else:
            tuned = triton.autotune(configs, key=_KEY, do_bench=_quick_bench,
                                    prune_configs_by={"early_config_prune": _prune_tall_tiles})
        _launchers[key] = tuned(_wna16_gemm_kernel)
    return _launchers[key]


# ----------------------------------------------------------------------------- wrapper


def _check_inputs(x, weight_packed, weight_scale, bits, group_size, weight_zero_point, g_idx, bias):
    """Validate shapes and dtypes; return (N, K, group_size) with per-channel as group_size = K."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits} is not supported; expected one of {SUPPORTED_BITS}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise ValueError(f"weight_packed must be a 2-D int32 tensor [N, ceil(K*bits/32)], "
                         f"got {weight_packed.dtype} {list(weight_packed.shape)}")
    K = x.shape[-1]
    N = weight_packed.shape[0]
    words = math.ceil(K * bits / 32)
    if weight_packed.shape[1] != words:
        raise ValueError(f"weight_packed has {weight_packed.shape[1]} words per row, but x has K={K} "
                         f"inputs and bits={bits} need ceil(K*bits/32)={words}: check that "
                         f"x's last dimension is in_features and that bits is right")
    group_size = K if group_size is None or group_size == -1 else group_size
    if group_size <= 0:
        raise ValueError(f"group_size must be positive, None or -1 (per-channel), got {group_size}")
    n_groups = math.ceil(K / group_size)
    expected = (N, n_groups)
    if g_idx is None and tuple(weight_scale.shape) != expected:
        raise ValueError(f"weight_scale must be [N, ceil(K/group_size)] = {list(expected)} for "
                         f"K={K}, group_size={group_size}; got {list(weight_scale.shape)}")
    if g_idx is not None:
        if weight_scale.dim() != 2 or weight_scale.shape[0] != N:
            raise ValueError(f"weight_scale must be [N={N}, n_groups]; got {list(weight_scale.shape)}")
        if g_idx.shape != (K,) or g_idx.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"g_idx must be an int32 tensor [K={K}]; got {g_idx.dtype} {list(g_idx.shape)}")
    if weight_zero_point is not None:
        if weight_zero_point.shape != weight_scale.shape:
            raise ValueError(f"weight_zero_point must be unpacked, shaped like weight_scale "
                             f"{list(weight_scale.shape)}; got {list(weight_zero_point.shape)}")
        if weight_zero_point.dtype not in (torch.int8, torch.int32):
            raise ValueError(f"weight_zero_point must be int8 or int32, got {weight_zero_point.dtype}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must be [N={N}], got {list(bias.shape)}")
    return N, K, group_size


def _dot_dtype(dtype):
    """Operand dtype of tl.dot: x's dtype, except bf16 under the interpreter.

    Triton 3.9's interpreter multiplies the raw bits of bf16 operands in tl.dot. A bf16 x bf16
    product is exact in fp32, so running the dot in fp32 there computes the same sums.
    """
    if _INTERPRET and dtype == torch.bfloat16:
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def _check_device(x):
    if not (x.is_cuda or _INTERPRET):
        raise RuntimeError(f"wna16_matmul runs Triton kernels and needs a CUDA tensor (x is on {x.device}); "
                           "set TRITON_INTERPRET=1 before importing ptq.kernels to emulate on CPU, "
                           "or call wna16_matmul_reference")


def wna16_matmul(x, weight_packed, weight_scale, *, bits, group_size, weight_zero_point=None,
                 g_idx=None, bias=None):
    """y = x @ dequant(W)^T + bias for x [..., K]; returns [..., N] in x.dtype.

    group_size None (or -1) means per-channel (weight_scale [N, 1]).
    """
    N, K, group_size = _check_inputs(x, weight_packed, weight_scale, bits, group_size,
                                     weight_zero_point, g_idx, bias)
    _check_device(x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)  # [M, K]
    M = x2.shape[0]
    if M == 0:
        return x.new_empty(*lead, N)
    w = weight_packed.contiguous()  # [N, words]
    s = weight_scale
    z = weight_zero_point if weight_zero_point is not None else s  # placeholder pointer when symmetric
    g = g_idx.to(torch.int32) if g_idx is not None else w  # placeholder pointer without act-order
    decode = M <= SMALL_M
    # Decode accumulates split-K partials in a zeroed fp32 buffer; prefill writes y directly.
    y = torch.zeros(M, N, device=x.device, dtype=torch.float32) if decode else x.new_empty(M, N)

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    dot_dtype = _dot_dtype(x.dtype)
    args = (x2, w, s, z, g, bias if bias is not None else s, y,
            M, N, K, w.shape[1], triton.next_power_of_2(M),
            x2.stride(0), x2.stride(1), w.stride(0), s.stride(0), s.stride(1), z.stride(0), z.stride(1),
            y.stride(0), y.stride(1))
    meta = dict(BITS=bits, GROUP_SIZE=group_size, HAS_ZP=weight_zero_point is not None,
                HAS_G_IDX=g_idx is not None, HAS_BIAS=bias is not None,
                DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32")
    specialisation = (decode, x.dtype, s.dtype, z.dtype, *meta.items())
    caps = (_stage_cap[specialisation],) if specialisation in _stage_cap else _STAGE_CAPS
    for cap in caps:
        try:  # OutOfResources comes from loading the compiled kernel, before anything runs
            _launcher(decode, cap)[grid](*args, **meta)
        except OutOfResources:
            if cap == caps[-1]:
                raise
            continue
        _stage_cap[specialisation] = cap
        break
    return y.to(x.dtype).reshape(*lead, N)


# ----------------------------------------------------------------------------- reference


def unpack_int_weights(weight_packed, bits, K):
    """Torch reference unpacking: int32 [N, ceil(K*bits/32)] -> signed int32 [N, K]."""
    words = weight_packed.to(torch.int64) & 0xFFFFFFFF  # [N, W], as unsigned 32-bit values
    start = torch.arange(K, device=weight_packed.device) * bits  # [K], first bit of element k
    word, shift = start // 32, start % 32
    lo = words[:, word] >> shift  # [N, K]
    hi = words[:, (word + 1).clamp(max=words.shape[1] - 1)] << (32 - shift)  # bits that spilled over
    q = (lo | hi) & ((1 << bits) - 1)
    return (q - (1 << (bits - 1))).to(torch.int32)


def dequantize_weight(weight_packed, weight_scale, *, bits, group_size, K, dtype,
                      weight_zero_point=None, g_idx=None):
    """w[n, k] = (q[n, k] - z[n, g]) * s[n, g] computed in fp32, rounded to dtype: [N, K]."""
    group_size = K if group_size is None or group_size == -1 else group_size
    q = unpack_int_weights(weight_packed, bits, K)  # [N, K]
    g = g_idx.long() if g_idx is not None else torch.arange(K, device=q.device) // group_size  # [K]
    if weight_zero_point is not None:
        q = q - weight_zero_point.to(torch.int32)[:, g]
    return (q.float() * weight_scale.float()[:, g]).to(dtype)


def wna16_matmul_reference(x, weight_packed, weight_scale, *, bits, group_size, weight_zero_point=None,
                           g_idx=None, bias=None):
    """Plain torch: dequantize to x.dtype, matmul accumulating in fp32, add bias, cast."""
    N, K, group_size = _check_inputs(x, weight_packed, weight_scale, bits, group_size,
                                     weight_zero_point, g_idx, bias)
    w = dequantize_weight(weight_packed, weight_scale, bits=bits, group_size=group_size, K=K,
                          dtype=x.dtype, weight_zero_point=weight_zero_point, g_idx=g_idx)  # [N, K]
    y = x.float() @ w.float().T  # [..., N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
