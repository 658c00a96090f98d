"""ptq's compiled loops, loaded with ctypes: GPTQ's column loop (gptq_loop.c, driven by
gptq_compiled), AWQ's candidate grid (awq_grid.c, driven from here), the passes over bf16
weights around it and SmoothQuant (smooth_weights.c, driven by smooth_compiled), int32 packing
(ptq/packing.c, driven from ptq.packing), and sums of bf16 products on AMX tiles
(ptq/calibration/gram_amx.c: Hessians and AWQ's Gram loss; GramTiles, QuadraticForm) or,
on a CPU with AVX512-BF16 and no AMX, with VDPBF16PS (the same two), the calibration
passes' causal attention (ptq/cpu_attention.c, driven from ptq.cpu_attention), RMSNorms
(ptq/cpu_norm.c, driven from ptq.cpu_norm), SiLU-gated products (ptq/cpu_mlp.c, driven
from ptq.cpu_mlp) and per-channel sums and maxima of |x|
(ptq/calibration/channel_stats.c, driven from here: abs_column_stat), and
moves of 32-bit matrices (transpose.c): transposed copies with a gather (GPTQ's working
copy and its codes), a gather of rows and columns, a triangle mirrored, a reversal in place.
The Cholesky factorisation (linalg.c) is driven from compiled_cholesky, its GEMM from here.
One library, built at install when a C compiler is there (setup.py); without one ptq
installs all the same, runs the torch references, and the report says so.

The loops do the float32 steps of the torch references (no fused multiply-adds formed by
the compiler, sums in a fixed order), so their bits do not depend on the CPU or on how
threads share the work. The AMX sums run only where the CPU has AMX, the VDPBF16PS ones
where it has AVX512-BF16 and no AMX; they are float32 sums in other orders than the oneDNN
GEMMs used elsewhere, so a checkpoint made with them may differ in the last bits from one
made on another kind of CPU.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from ptq._sources import source_digest
from ptq.devices import cpu_budget, cpu_parallel
from ptq.schemes import QuantArgs

ABI = 21  # PTQ_COMPILED_ABI in quant_math.h: the arguments this module passes
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C code's SCALE_* numbers
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
_TRANSPOSES = {  # (source dtype's size, target's) -> transpose.c's function; 2 -> 4 widens bf16
    (1, 1): "ptq_transpose_8", (2, 2): "ptq_transpose_16", (4, 4): "ptq_transpose_32", (2, 4): "ptq_transpose_bf16_f32",
}
TRANSPOSE_TASK = 1 << 18  # elements of the target per task at least (smaller copies: one task)


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str | None]:
    """The loaded library, or None and why not."""
    spec = importlib.util.find_spec("ptq.algorithms._compiled")
    if spec is None or not spec.origin:
        return None, "ptq was installed without its compiled loops (no C compiler at install time)"
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as error:
        return None, f"ptq's compiled loops do not load: {error}"
    if not hasattr(lib, "ptq_compiled_abi") or lib.ptq_compiled_abi() != ABI:
        return None, f"ptq's compiled loops at {spec.origin} were built for another version: reinstall ptq"
    lib.ptq_compiled_source.restype = ctypes.c_char_p
    built, here = lib.ptq_compiled_source().decode(), source_digest(Path(__file__).parents[1])
    if built and here and built != here:
        return None, (f"ptq's compiled loops at {spec.origin} were built from other C sources than the ones "
                      "beside it (changed since, or a rebuild failed): reinstall ptq (pip install -e .)")
    lib.ptq_gptq_block.restype = ctypes.c_int
    lib.ptq_gptq_block.argtypes = [  # rows r0, r1, positions i1, i2 and the loss's place first: they change
        _I, _I, _I, _I, _P, _P, _P, _I, _P, _I, _I, _P, _P, _P, _P, _I, _P, _P, _P, _C, _F, _F, _P, _I, _F, _C,
    ]
    lib.ptq_gptq_has_float16.restype = ctypes.c_int
    lib.ptq_awq_candidates.restype = ctypes.c_int
    lib.ptq_awq_candidates.argtypes = [_I, _I, _P, _I, _P, _I, _C, _F, _F, _C, _C, _C, _C, _P, _C]
    lib.ptq_amx_available.restype = ctypes.c_int
    lib.ptq_amx_available.argtypes = []
    lib.ptq_gram_pack.restype = None
    lib.ptq_gram_pack.argtypes = [_P, _I, _I, _I, _I, _I, _I, _P, _P]
    lib.ptq_gram_amx.restype = None
    lib.ptq_gram_amx.argtypes = [_P, _P, _I, _I, _I, _I, _I, _I, _P, _I, ctypes.c_int]
    lib.ptq_avx512bf16_available.restype = ctypes.c_int
    lib.ptq_avx512bf16_available.argtypes = []
    lib.ptq_gram_avx512.restype = None
    lib.ptq_gram_avx512.argtypes = [_P, _I, _I, _I, _I, _I, _I, _P, _I, ctypes.c_int]
    lib.ptq_attention_causal.restype = ctypes.c_int
    lib.ptq_attention_causal.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _F]
    lib.ptq_attention_causal_amx.restype = ctypes.c_int
    lib.ptq_attention_causal_amx.argtypes = lib.ptq_attention_causal.argtypes
    lib.ptq_attention_causal_f32.restype = ctypes.c_int
    lib.ptq_attention_causal_f32.argtypes = lib.ptq_attention_causal.argtypes
    lib.ptq_attention_f32_available.restype = ctypes.c_int
    lib.ptq_attention_f32_available.argtypes = []
    lib.ptq_gram_quadratic.restype = ctypes.c_double
    lib.ptq_gram_quadratic.argtypes = [_P, _I, _I, _P]
    lib.ptq_gram_quadratic_avx512.restype = ctypes.c_double
    lib.ptq_gram_quadratic_avx512.argtypes = [_P, _I, _I, _P]
    lib.ptq_gram_quadratic_pack.restype = None
    lib.ptq_gram_quadratic_pack.argtypes = [_P, _I, _I, _I, _I, _P]
    lib.ptq_abs_over_max.restype = ctypes.c_int
    lib.ptq_abs_over_max.argtypes = [_P, _I, _I, _I, _P]
    lib.ptq_scale_bf16.restype = ctypes.c_int
    lib.ptq_scale_bf16.argtypes = [_P, _I, _I, _P, _C, _P]
    lib.ptq_linalg_available.restype = ctypes.c_int
    lib.ptq_linalg_available.argtypes = []
    lib.ptq_gemm_subtract.restype = ctypes.c_int
    lib.ptq_gemm_subtract.argtypes = [_P, _I, _P, _I, _I, _P, _I, _I, _I, _I]
    lib.ptq_cholesky_padded.restype = ctypes.c_int
    lib.ptq_cholesky_padded.argtypes = [_P, _I, _I, _P, _P, _P, _C]
    lib.ptq_cholesky_copy.restype = ctypes.c_int
    lib.ptq_cholesky_copy.argtypes = [_P, _I, _I, _P, _P, _P]
    lib.ptq_cholesky_shared.restype = ctypes.c_int
    lib.ptq_cholesky_shared.argtypes = [_P, _I, _P, _P]
    lib.ptq_cholesky_scratch.restype = None
    lib.ptq_cholesky_scratch.argtypes = [_I, _P]
    lib.ptq_inverse_tiles.restype = None
    lib.ptq_inverse_tiles.argtypes = [_P, _I, _P, _P, _C]
    lib.ptq_inverse_copy.restype = ctypes.c_int
    lib.ptq_inverse_copy.argtypes = [_P, _I, _I, _P]
    lib.ptq_feedback_copy.restype = ctypes.c_int
    lib.ptq_feedback_copy.argtypes = [_P, _I, _I, _P]
    lib.ptq_pack_int32.restype = None
    lib.ptq_pack_int32.argtypes = [_P, _I, _I, _I, _C, _P, _I]
    lib.ptq_unpack_int32.restype = None
    lib.ptq_unpack_int32.argtypes = [_P, _I, _I, _C, _I, _P]
    lib.ptq_dequantize_packed.restype = None
    lib.ptq_dequantize_packed.argtypes = [_P, _I, _C, _I, _P, _C, _I, _P, _P, _I, _P]
    for name in (*_TRANSPOSES.values(), "ptq_gather_32"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [_P, _I, _P, _P, _I, _I, _I, _P]
    lib.ptq_mirror_32.restype = None
    lib.ptq_mirror_32.argtypes = [_P, _I, _I, _I, _I, _C]
    lib.ptq_reverse_32.restype = None
    lib.ptq_reverse_32.argtypes = [_P, _I, _I, _I]
    lib.ptq_rms_norm_bf16.restype = ctypes.c_int
    lib.ptq_rms_norm_bf16.argtypes = [_P, _I, _P, _I, _I, _I, _F, _C, _C, _P, _I]
    lib.ptq_sum_squares_bf16.restype = ctypes.c_int
    lib.ptq_sum_squares_bf16.argtypes = [_P, _I, _I, _I, _C, _P]
    lib.ptq_silu_mul_bf16.restype = ctypes.c_int64
    lib.ptq_silu_mul_bf16.argtypes = [_P, _I, _P, _I, _I, _I, _P, _C, _P]
    lib.ptq_rotary.restype = ctypes.c_int64
    lib.ptq_rotary.argtypes = [_P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _I, _I, _C, _C, _P, _I, _I, _I]
    for name in ("ptq_abs_column_sums", "ptq_abs_column_maxs"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [_P, _I, _I, _I, _I, _C, _P]
    return lib, None


def unavailable() -> str | None:
    """Why the compiled loops cannot be used, or None when they can."""
    return library()[1]


def has_dtypes(*dtypes: torch.dtype) -> bool:
    """Whether the compiled code rounds to every one of these dtypes (float16 needs a
    compiler with _Float16)."""
    lib = library()[0]
    if lib is None or any(d not in KINDS for d in dtypes):
        return False
    return torch.float16 not in dtypes or bool(lib.ptq_gptq_has_float16())


def awq_grid_for(W: Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> bool:
    """Whether AWQ's candidate weights of W [out, in] come from the compiled grid: integer
    group or channel schemes on a CPU (a per-tensor range spans every row)."""
    if W.device.type != "cpu" or args.type != "int" or args.strategy not in ("group", "channel"):
        return False
    if args.strategy == "group" and W.shape[1] % args.group_size:
        return False
    return has_dtypes(scale_dtype, W.dtype)


def awq_candidate(W32: Tensor, s: Tensor, args: QuantArgs, scale_dtype: torch.dtype, weight_dtype: torch.dtype,
                  out: Tensor, delta: bool, portable: bool = False, bf16_instructions: bool = True) -> Tensor:
    """Q(W·diag(s))·diag(1/s) rounded to weight_dtype (minus W when delta) into out [out, in]
    (float32, bf16 or float16): awq.candidate_weights for one candidate s [in], from
    W32 [out, in], W's values in float32 (awq_grid_for must have said yes). portable: not
    the AVX-512 path; bf16_instructions False: that path without AVX512-BF16's rounding
    instruction. All three give the same bits (both flags for tests)."""
    rows, cols = W32.shape
    assert W32.dtype == s.dtype == torch.float32 and W32.is_contiguous() and s.is_contiguous()
    assert out.shape == W32.shape and out.is_contiguous() and out.dtype in KINDS
    size = args.group_size if args.strategy == "group" else cols
    status = library()[0].ptq_awq_candidates(
        0, rows, W32.data_ptr(), cols, s.data_ptr(), size, KINDS[scale_dtype], float(args.qmin), float(args.qmax),
        int(not args.symmetric), KINDS[weight_dtype], int(delta), KINDS[out.dtype], out.data_ptr(),
        1 if portable else 0 if bf16_instructions else 2)  # the C code's path: PORTABLE 1, NO_BF16_ROUNDING 2
    if status:
        raise MemoryError("AWQ's compiled grid ran out of memory for one row")
    return out


def amx() -> bool:
    """Whether sums of bf16 products can run on AMX tiles here (gram_amx.c): the library is
    built, the CPU has AMX-BF16 and the OS granted this process its tile state."""
    return _library_says("ptq_amx_available")


def gram_kernel() -> str | None:
    """How GramTiles sums bf16 products here: "AMX" (tiles), "AVX512-BF16" (VDPBF16PS, on
    a CPU that has it without AMX), or None (no such CPU, or the library is not built)."""
    if amx():
        return "AMX"
    return "AVX512-BF16" if avx512_bf16() else None


def avx512_bf16() -> bool:
    """Whether the library's VDPBF16PS code runs here (built; AVX512-F, BW, VL and BF16)."""
    return _library_says("ptq_avx512bf16_available")


def attention_f32() -> bool:
    """Whether the library's float32 causal attention runs here (built; AVX2 and FMA)."""
    return _library_says("ptq_attention_f32_available")


def _library_says(probe: str) -> bool:
    """Whether the library is built and its probe (a C function that tests the CPU, e.g.
    ptq_amx_available) says yes; asked once per process."""
    lib = library()[0]
    return lib is not None and _probe(lib, probe)


@functools.cache
def _probe(lib: ctypes.CDLL, probe: str) -> bool:
    return bool(getattr(lib, probe)())


class GramTiles:
    """Buffers for up to `capacity` tokens of n features (bf16, n a multiple of 32) laid out
    as AMX tiles (gram_amx.c), reused chunk after chunk: load(X) takes a chunk X [T, n],
    pack(f0, f1) lays out its feature blocks [f0, f1) of 16 (callers may split them across
    threads), then gram_rows adds its XᵀX to rows of a sum, on AMX tiles or, where the CPU
    has AVX512-BF16 and no AMX, with VDPBF16PS from the B tiles alone (gram_kernel)."""

    def __init__(self, capacity: int, features: int):
        self.kernel = gram_kernel()
        assert self.kernel and features % 32 == 0
        self.features, self.stride = features, -(-capacity // 32)  # tiles per block of 16 features
        self.XV = torch.empty(self.stride * 32 * features, dtype=torch.bfloat16)  # B tiles
        # A tiles: AMX only (VDPBF16PS reads the B tiles alone)
        self.XT = torch.empty(self.stride * 32 * features if self.kernel == "AMX" else 0, dtype=torch.bfloat16)
        self.X, self.padded = None, 0

    def load(self, X: Tensor) -> None:
        assert X.dtype == torch.bfloat16 and X.dim() == 2 and X.stride(1) == 1 and X.shape[1] == self.features
        self.X, self.padded = X, -(-X.shape[0] // 32) * 32  # tokens up to a whole tile, zeros after
        assert self.padded <= 32 * self.stride

    def pack(self, f0: int, f1: int) -> None:
        library()[0].ptq_gram_pack(self.X.data_ptr(), self.X.shape[0], self.X.stride(0), self.padded, self.stride,
                                   f0, f1, self.XV.data_ptr(), self.XT.data_ptr() if self.kernel == "AMX" else None)

    def gram_rows(self, total: Tensor, i0: int, i1: int, fresh: bool = False) -> None:
        """total[i0:i1, i0:] += X[:, i0:i1]ᵀ X[:, i0:] in the 32 x 32 blocks on and above the
        diagonal (float32 [n, n], contiguous; i0, i1 multiples of 32); fresh: = instead of
        +=, those blocks' old values neither read nor needed (the same bits as adding to
        zeros)."""
        n = self.features
        assert total.dtype == torch.float32 and total.shape == (n, n) and total.is_contiguous()
        assert i0 % 32 == 0 and i1 % 32 == 0 and 0 <= i0 < i1 <= n
        if self.kernel == "AMX":
            library()[0].ptq_gram_amx(self.XV.data_ptr(), self.XT.data_ptr(), self.padded, self.stride, n, i0, i1, i0,
                                      total.data_ptr(), n, int(fresh))
        else:
            library()[0].ptq_gram_avx512(self.XV.data_ptr(), self.padded, self.stride, n, i0, i1, i0,
                                         total.data_ptr(), n, int(fresh))


class QuadraticForm:
    """d -> Σ_r d_r G d_rᵀ for a fixed symmetric G [in, in] (rounded to bf16) and many
    D [rows, in] (bf16; rows and in multiples of 32), on AMX tiles (gram_amx.c) or, on a
    CPU with AVX512-BF16 and no AMX, with VDPBF16PS (gram_kernel): the 32 x 32 blocks of G
    on and above the diagonal only, those above doubled (exact in bf16), so half the
    multiply-adds of D·G; sums in float32 tiles or lanes, then float64."""

    def __init__(self, G: Tensor):
        kernel, lib = gram_kernel(), library()[0]
        assert kernel and G.dim() == 2 and G.shape[0] == G.shape[1] and G.shape[0] % 32 == 0
        self._quadratic = lib.ptq_gram_quadratic if kernel == "AMX" else lib.ptq_gram_quadratic_avx512
        G = G.float()
        assert G.stride(1) == 1
        self.features = n = G.shape[0]
        # [column block, row block, half of 16 columns, row pair, column, row of the pair]
        self.GV = torch.empty(n // 32, n // 32, 2, 16, 16, 2, dtype=torch.bfloat16)
        blocks, threads = n // 32, cpu_budget()
        cuts = [round(blocks * (t / threads) ** 0.5) for t in range(threads + 1)]  # column block jb has jb + 1
        cpu_parallel([functools.partial(library()[0].ptq_gram_quadratic_pack, G.data_ptr(), n, G.stride(0), a, b,
                                        self.GV.data_ptr()) for a, b in zip(cuts, cuts[1:]) if b > a], threads)

    def of(self, D: Tensor) -> float:
        assert D.dtype == torch.bfloat16 and D.is_contiguous() and D.dim() == 2 and D.shape[1] == self.features
        assert D.shape[0] % 32 == 0
        return self._quadratic(D.data_ptr(), D.shape[0], self.features, self.GV.data_ptr())


def linalg_available() -> bool:
    """Whether the compiled factorisation runs here (the library is built and the CPU has
    AVX-512, or AVX2 and FMA)."""
    return linalg_kind() is not None


def gemm_available() -> bool:
    """Whether gemm_subtract runs here (built, AVX-512)."""
    return linalg_kind() == "AVX-512"


@functools.cache
def linalg_kind() -> str | None:
    """The vector code linalg.c runs here: "AVX-512", "AVX2", or None (not built, or
    neither)."""
    lib = library()[0]
    level = lib.ptq_linalg_available() if lib is not None else 0
    return {2: "AVX-512", 1: "AVX2"}.get(level)


def gemm_subtract(C: Tensor, A: Tensor, B: Tensor) -> None:
    """C -= A @ B in place, float32 CPU tensors: C [m, n] and B [k, n] with rows of unit
    stride, A [m, k] any strides; on this thread (linalg.c; gemm_available must have
    said yes). Each element is C's value less its products in order, one rounding each,
    whatever the shapes: a slice of C's rows or columns gets the bits of the whole."""
    (m, n), k = C.shape, A.shape[1]
    assert C.dtype == A.dtype == B.dtype == torch.float32 and A.shape == (m, k) and B.shape == (k, n)
    assert C.stride(1) == 1 and B.stride(1) == 1 and C.device.type == "cpu"
    status = library()[0].ptq_gemm_subtract(C.data_ptr(), C.stride(0), A.data_ptr(), A.stride(0), A.stride(1),
                                             B.data_ptr(), B.stride(0), m, n, k)
    assert status == 0, "the compiled GEMM needs AVX-512"


def abs_column_stat(x: Tensor, stat: str) -> Tensor | None:
    """Σ_r |x[r, c]| (stat "sum") or max_r |x[r, c]| ("max") over the rows of x [rows, n],
    float32 [n], in one pass over x (channel_stats.c: its sums in one fixed order); None
    where the compiled code does not take x (the library not built, not a CPU tensor, a
    dtype other than bf16 and float32, not unit stride along n): the caller uses torch."""
    lib = library()[0]
    if lib is None or x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2:
        return None
    if x.shape[1] > 1 and x.stride(1) != 1:
        return None
    out = torch.empty(x.shape[1], dtype=torch.float32)
    function = {"sum": lib.ptq_abs_column_sums, "max": lib.ptq_abs_column_maxs}[stat]
    function(x.data_ptr(), x.stride(0), x.shape[0], 0, x.shape[1], int(x.dtype == torch.bfloat16), out.data_ptr())
    return out


def transposed(src: Tensor, rows: Tensor | None = None, cols: Tensor | None = None,
               dtype: torch.dtype | None = None) -> Tensor | None:
    """src [m, n] with its rows, then its columns, picked by the index tensors `rows` and
    `cols` (all when None), transposed, as a new contiguous tensor of `dtype` (src's by
    default): out[i, j] = src[rows[j], cols[i]], what
    src.index_select(0, rows).index_select(1, cols).t().to(dtype) holds, 2-3 times
    faster than torch's strided copies here (transpose.c), on all threads. None where the
    compiled copy does not apply (use torch): another device, a conversion other than
    bf16 to float32, or no compiled library."""
    dtype = src.dtype if dtype is None else dtype
    lib = _moves(src, sizes=(1, 2, 4))
    if lib is None or not (dtype == src.dtype or (src.dtype == torch.bfloat16 and dtype == torch.float32)):
        return None
    R, C = c_indices(rows, src.shape[0]), c_indices(cols, src.shape[1])
    nj = src.shape[0] if R is None else R.numel()
    ni = src.shape[1] if C is None else C.numel()
    out = torch.empty(ni, nj, dtype=dtype)
    if out.numel() == 0:
        return out
    copy = getattr(lib, _TRANSPOSES[src.element_size(), out.element_size()])
    pointers = (src.data_ptr(), src.stride(0), c_pointer(R), c_pointer(C))
    cpu_parallel([functools.partial(copy, *pointers, i0, i1, nj, out.data_ptr()) for i0, i1 in _ranges(ni, out.numel())],
                 cpu_budget())
    return out


def c_pointer(t: Tensor | None) -> int | None:
    """t's data pointer for the C code, None (NULL) for no tensor (here and in
    compiled_cholesky)."""
    return None if t is None else t.data_ptr()


def c_indices(index: Tensor | None, size: int) -> Tensor | None:
    """index as contiguous int64 positions among `size`, checked (the C code reads them as
    they are)."""
    if index is None:
        return None
    index = index.to(torch.int64).contiguous()
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < size):
        raise IndexError(f"indices from {int(index.min())} to {int(index.max())} do not all fall in [0, {size})")
    return index


def _moves(A: Tensor, sizes: tuple[int, ...] = (4,)) -> ctypes.CDLL | None:
    """The library where transpose.c's moves apply to A (a CPU matrix of real elements of
    one of these sizes in bytes, rows of unit stride), else None."""
    lib = library()[0]
    ok = A.device.type == "cpu" and A.dim() == 2 and A.element_size() in sizes and not A.is_complex()
    return lib if ok and A.stride(1) == 1 else None


def _ranges(total: int, work: int, position: Callable[[float], float] = lambda f: f) -> list[tuple[int, int]]:
    """[0, total) cut into one range per thread of about equal work (work: elements moved in
    all, at least TRANSPOSE_TASK per range); position(f): where the first f of the work ends,
    as a fraction of total (uniform work: f itself)."""
    tasks = max(1, min(cpu_budget(), work // TRANSPOSE_TASK))
    cuts = sorted({0, total, *(round(total * position(t / tasks)) for t in range(1, tasks))})
    return list(zip(cuts, cuts[1:]))


def gathered(src: Tensor, rows: Tensor, cols: Tensor) -> Tensor | None:
    """src[rows][:, cols] as a new contiguous matrix, in one pass on all threads (torch's
    two index_selects: 2 passes), or None where the compiled move does not apply."""
    lib = _moves(src)
    if lib is None:
        return None
    R, C = c_indices(rows, src.shape[0]), c_indices(cols, src.shape[1])
    out = torch.empty(R.numel(), C.numel(), dtype=src.dtype)
    cpu_parallel([functools.partial(lib.ptq_gather_32, src.data_ptr(), src.stride(0), R.data_ptr(), C.data_ptr(),
                                    i0, i1, C.numel(), out.data_ptr()) for i0, i1 in _ranges(R.numel(), out.numel())],
                 cpu_budget())
    return out


def mirror_(A: Tensor, to_upper: bool = False) -> bool:
    """A [n, n]'s strict lower triangle from its strict upper one (A[i, j] = A[j, i] for
    j < i), or with to_upper the other way round, in place, on all threads. False (A
    unchanged) where the compiled move does not apply."""
    lib = _moves(A)
    if lib is None or A.shape[0] != A.shape[1]:
        return False
    n = A.shape[0]
    # row i moves i entries into the lower triangle, n - 1 - i into the upper one
    position = (lambda f: 1 - (1 - f) ** 0.5) if to_upper else (lambda f: f**0.5)
    cpu_parallel([functools.partial(lib.ptq_mirror_32, A.data_ptr(), n, A.stride(0), i0, i1, int(to_upper))
                  for i0, i1 in _ranges(n, n * n // 2, position)], cpu_budget())
    return True


def reverse_(A: Tensor) -> bool:
    """A's storage reversed in place, on all threads: for A dense (in either layout) what
    A.flip((0, 1)) holds. False (A unchanged) where the compiled move does not apply: not
    a dense CPU matrix of 4-byte real elements."""
    lib = library()[0]
    dense = A.dim() == 2 and (A.is_contiguous() or A.mT.is_contiguous())
    if lib is None or A.device.type != "cpu" or A.element_size() != 4 or A.is_complex() or not dense:
        return False
    half = A.numel() // 2
    cpu_parallel([functools.partial(lib.ptq_reverse_32, A.data_ptr(), A.numel(), k0, k1)
                  for k0, k1 in _ranges(half, 2 * half)], cpu_budget())
    return True
