"""Observers: running statistics of a Linear's input, updated batch by batch in float32.

With several processes (ptq.distributed), each observes its own calibration samples and
the first read of `value` combines the ranks' statistics (sums add up, maxima take the
larger): a collective call, which every rank makes for the same observers in the same
order, as the ranks run the same code. With one process it costs nothing.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ptq.algorithms import compiled
from ptq.algorithms.cholesky import mirror_triangle_
from ptq.devices import bf16_valued_gemms_exact, cpu_budget, cpu_parallel, float32_gemms
from ptq.distributed import all_reduce_, all_reduce_count


class Observer:
    """Accumulates a statistic of x [..., in_features] over calibration batches."""

    def update(self, x: Tensor) -> None:
        raise NotImplementedError

    @property
    def value(self) -> Tensor:
        raise NotImplementedError

    def updates_alone(self, features: int, dtype: torch.dtype) -> bool:
        """Whether update() on CPU inputs of this width and dtype runs on the calling thread
        alone, leaving the other threads free (a pass may then run its next batches while
        the caller updates: sequential._stage_pass)."""
        return False


class HessianObserver(Observer):
    """H = 2/N · Σ x xᵀ over all N tokens seen: float32 [in, in].

    H is symmetric: the features are split into blocks (row_blocks) and only the blocks
    on and above the diagonal are accumulated (with 11 blocks, 66 of 121: 45% fewer FLOPs);
    the others are mirrored when H is read.

    bf16 inputs on a CPU with AMX (and a feature count that is a multiple of 32) are summed
    on AMX tiles by ptq's compiled code (compiled.GramTiles): bf16 products summed in
    float32, 1.3 TFLOP/s on one core of a Xeon, 2.6x the oneDNN GEMMs below. On a CPU with
    AVX512-BF16 and no AMX the same code sums them with VDPBF16PS, in float32 sums of 128
    tokens added up (more accurate than the GEMMs below, and 2.2-2.9x their speed on a
    2-core EPYC: 1.2 against 3.6 ms for 2048 tokens of 576 features). Elsewhere, bf16
    inputs on a CPU with fast bf16 GEMMs are converted to float32 and multiplied in bf16
    (devices.float32_gemms): the products of bf16 values are exact and their sums float32,
    so H is as accurate as a float32 GEMM makes it, at 2.7x its speed here (and 1.6x the
    speed of the two bf16 GEMMs, product and rounding error, used before).

    On AMX tiles every element gets its tokens' products added in token order, however the
    rows are split; there only the 32 x 32 blocks on and above the diagonal are summed, the
    first chunk written rather than added to zeros (the sum is not zeroed first: 1536 x 1536
    is 9 MB to write, and the first chunk of each block's down_proj Hessian took 6.0 ms
    against 3.3 for the next ones in the SmolLM2-shaped job). Below the diagonal the sum is
    never read, whatever wrote there (the float32 GEMMs' rows of blocks reach into it): gram
    mirrors the strict upper triangle over it.
    Batches of another dtype than the first are flushed and summed in their own way.

    On a CPU each row of blocks is one GEMM on one thread, the rows spread over the threads
    (devices.cpu_parallel), so that H does not depend on the thread count: MKL and oneDNN
    split a GEMM's long sums across threads, rounding differently for each count (float32:
    2048 tokens differ between 1 and 2 threads; bf16: 1024 tokens between 1 and 3). On
    SmolLM2's and Llama's shapes this is 2 to 4 times faster than the threaded GEMMs over
    512-token chunks it replaced, whose threads synchronised for every small GEMM (issue
    15). Batches are gathered (copied) up to PENDING_TOKENS tokens first, for longer GEMMs.
    On a GPU, where a sum does not depend on a thread count, each batch's GEMMs run in turn,
    on bf16 / fp16 inputs as they are with float32 output (mixed_gram_available).
    """

    BLOCK = 256
    SPLIT, NARROWEST = 6, 64  # smaller H: at least SPLIT rows of blocks, none under NARROWEST rows
    TILE_PIECES = 2  # on AMX tiles: blocks of rows per thread, of about equal work
    PENDING_TOKENS = 2048  # on a CPU, tokens gathered before the GEMMs run (fewer, longer ones)
    PENDING_BYTES = 64 * 2**20  # at most, for wide inputs (with the AMX tiles' buffers)
    ONE_THREAD_FEATURES = 768  # on AMX tiles, up to this many features on one thread (_accumulate_tiles)
    CACHED_TOKENS = 512  # tokens laid out and summed at a time there

    def __init__(self) -> None:
        self.sum: Tensor | None = None
        self.tokens = 0
        self._value: Tensor | None = None
        self._read = False  # the sum was read (gram): no more batches
        self._pending: Tensor | None = None  # [cap, in] float32 (bf16 for AMX): inputs not yet in the sum (CPU)
        self._filled = 0
        self._bf16_values = False  # the pending inputs are bf16 values: float32_gemms("bf16")
        self._on_tiles = False  # the pending inputs are bf16, summed by compiled.GramTiles
        self._tiles: compiled.GramTiles | None = None
        self._modes: tuple[bool, int] | None = None  # what chose the two above: bf16 inputs, features

    @classmethod
    def row_blocks(cls, n: int, tiles: bool = False) -> list[int]:
        """Where the rows of blocks of n features start and end: about BLOCK rows each for
        GEMMs, and for fewer than SPLIT * BLOCK features SPLIT rows (of NARROWEST rows at
        least): rows of blocks cost n - a, so a few wide ones leave threads idle (256
        features were one GEMM on one thread; 576 two, of 2:1 work) and sum more of the lower
        triangle (on a 2-core AVX2 EPYC, 2048 tokens: 256 features 3.25 -> 1.18 ms, 576 9.1 ->
        6.1 ms, 768 11.4 -> 9.7 ms on two threads). On AMX tiles (tiles; n a multiple of 32),
        which sum only the 32 x 32 blocks on and above the diagonal, TILE_PIECES blocks of
        about equal work per thread."""
        if tiles:  # blocks of about equal work: rows of 32 features g = 0, 1, ... cost n - 32g
            groups = n // 32
            pieces, total = min(groups, cls.TILE_PIECES * cpu_budget()), groups * (n + 32) // 2
            edges, done = [0], 0
            for g in range(groups - 1):
                done += n - 32 * g
                if done * pieces >= total * len(edges):
                    edges.append(32 * (g + 1))
            return edges + [n]
        blocks = max(1, n // cls.BLOCK, min(cls.SPLIT, n // cls.NARROWEST))
        return [n * b // blocks for b in range(blocks + 1)]

    @classmethod
    def macs(cls, n: int, tiles: bool = False) -> int:
        """Multiply-adds per token of one H [n, n], as row_blocks sum it."""
        if tiles:
            return sum(32 * (n - i) for i in range(0, n, 32))
        edges = cls.row_blocks(n)
        return sum((b - a) * (n - a) for a, b in zip(edges, edges[1:]))

    def update(self, x: Tensor) -> None:
        if self._read:
            raise RuntimeError("this Hessian was read already; use a new observer for more batches")
        flat = x.reshape(-1, x.shape[-1])  # [tokens, in]
        self.tokens += flat.shape[0]
        if flat.device.type != "cpu":  # bf16 / fp16 stay as they are where the GPU's GEMMs take them
            self._accumulate(flat if mixed_gram_available(flat) else flat.float())
            return
        if self._pending is not None and self._modes != (flat.dtype == torch.bfloat16, self._pending.shape[1]):
            self._flush()  # batches of another dtype: summed in their own mode
            self._pending = self._tiles = None
        if self._pending is None:  # copies, not references: a caller may reuse x's memory
            self._on_tiles = self._takes_tiles(flat.shape[1], flat.dtype)
            # bytes per token held: float32 inputs, or bf16 inputs and their tile layouts (AMX: two)
            held = (6 if self._on_tiles and compiled.gram_kernel() == "AMX" else 4) * flat.shape[1]
            cap = max(1, min(self.PENDING_TOKENS, self.PENDING_BYTES // held))
            self._pending = torch.empty(cap, flat.shape[1], dtype=torch.bfloat16 if self._on_tiles else torch.float32)
            self._bf16_values = _bf16_valued(flat)
            self._modes = (flat.dtype == torch.bfloat16, flat.shape[1])
        cap, start = self._pending.shape[0], 0
        direct = flat.dtype == self._pending.dtype and flat.stride(1) == 1
        while start < flat.shape[0]:
            take = min(cap - self._filled, flat.shape[0] - start)
            if direct and take == cap:  # a whole chunk (none pending): summed where it is, not copied
                self._sum(flat[start:start + take])
            else:
                self._pending[self._filled:self._filled + take] = flat[start:start + take]
                self._filled += take
                if self._filled == cap:
                    self._flush()
            start += take

    def _flush(self) -> None:
        if self._filled:
            self._sum(self._pending[: self._filled])
        self._filled = 0

    def _sum(self, chunk: Tensor) -> None:
        """sum += chunkᵀ chunk, chunk [tokens, in] in the pending buffer's dtype."""
        if self._on_tiles:
            self._accumulate_tiles(chunk)
        else:
            self._accumulate(chunk)

    def _accumulate(self, flat: Tensor) -> None:
        """sum += flatᵀ flat for flat [tokens, in] float32."""
        n = flat.shape[1]
        if self.sum is None:
            self.sum = torch.zeros(n, n, dtype=torch.float32, device=flat.device)
        edges = self.row_blocks(n)
        rows = [functools.partial(self._add_rows, flat, a, b) for a, b in zip(edges, edges[1:])]
        if flat.device.type != "cpu":
            for add in rows:
                add()
            return
        with float32_gemms("bf16" if self._bf16_values else "ieee"):
            cpu_parallel(rows, cpu_budget())

    def _accumulate_tiles(self, flat: Tensor) -> None:
        """sum += flatᵀ flat for flat [tokens, in] bf16 by compiled.GramTiles (AMX tiles or
        VDPBF16PS): the tokens laid out as tiles, feature blocks split across the threads, then each
        row of blocks on one thread, as in _add_rows.

        On AMX tiles, up to ONE_THREAD_FEATURES features, this thread alone lays out and sums
        CACHED_TOKENS tokens at a time, whose tiles stay in its L2 cache between the two: on
        a 2-core Xeon, per 2048 tokens, 256 features 0.23 ms against 0.46 on both threads,
        576 0.83 against 0.99, 768 1.41-1.48 against 1.39 (1024: 2.47 against 1.93), and
        the other core stays free for the calibration passes (the GPTQ job, alternating
        runs: bundled model 0.503 -> 0.478 s, SmolLM2-shaped 5.65 -> 5.50-5.58 s, medians).
        Every element still adds its tokens' products in token order: the same bits."""
        n = flat.shape[1]
        fresh = self.sum is None  # the first chunk writes the blocks it sums: no zeros to write first
        if fresh:
            self.sum = torch.empty(n, n, dtype=torch.float32)
        one_thread = self._one_thread(n)  # this thread alone, see the docstring
        if self._tiles is None:  # kept for the next chunks: no fresh pages to fault in each time
            capacity = self._pending.shape[0]
            self._tiles = compiled.GramTiles(min(capacity, self.CACHED_TOKENS) if one_thread else capacity, n)
        tiles, blocks = self._tiles, n // 16
        if one_thread:
            for start in range(0, flat.shape[0], self.CACHED_TOKENS):
                tiles.load(flat[start:start + self.CACHED_TOKENS])
                tiles.pack(0, blocks)
                tiles.gram_rows(self.sum, 0, n, fresh=fresh and start == 0)
            return
        tiles.load(flat)
        threads, edges = cpu_budget(), self.row_blocks(n, tiles=True)
        cuts = [blocks * t // threads for t in range(threads + 1)]
        cpu_parallel([functools.partial(tiles.pack, a, b) for a, b in zip(cuts, cuts[1:]) if b > a], threads)
        cpu_parallel([functools.partial(tiles.gram_rows, self.sum, a, b, fresh) for a, b in zip(edges, edges[1:])],
                     threads)

    def updates_alone(self, features: int, dtype: torch.dtype) -> bool:
        return self._takes_tiles(features, dtype) and self._one_thread(features)

    @staticmethod
    def _takes_tiles(features: int, dtype: torch.dtype) -> bool:
        """Whether CPU inputs of this width and dtype are summed by compiled.GramTiles."""
        return dtype == torch.bfloat16 and features % 32 == 0 and compiled.gram_kernel() is not None

    @classmethod
    def _one_thread(cls, features: int) -> bool:
        """Whether inputs that take the tiles (_takes_tiles) are summed on the calling thread
        alone (_accumulate_tiles)."""
        return features <= cls.ONE_THREAD_FEATURES and compiled.gram_kernel() == "AMX"

    def _add_rows(self, flat: Tensor, a: int, b: int) -> None:
        """The row of blocks [a, b) from the diagonal on: sum[a:b, a:] += flat[:, a:b]ᵀ flat[:, a:]."""
        if flat.dtype == torch.float32:
            self.sum[a:b, a:].addmm_(flat[:, a:b].t(), flat[:, a:])
        else:  # bf16 / fp16 on a GPU: exact products, float32 sums (mixed_gram_available)
            self.sum[a:b, a:].add_(torch.mm(flat[:, a:b].t(), flat[:, a:], out_dtype=torch.float32))

    @property
    def value(self) -> Tensor:
        """H, made from the running sum in place the first time it is read (no second
        [in, in] matrix: they are large); the observer takes no batches after that."""
        if self._value is None:
            self._value = self.gram().mul_(2.0 / self.tokens)
        return self._value

    def gram(self) -> Tensor:
        """Σ x xᵀ over every process's tokens (self.tokens, counted again), float32 [in, in]:
        the running sum itself, in place, its lower triangle mirrored from the upper one
        (whatever rows of blocks summed the upper triangle, row_blocks, they summed all of
        it); the observer takes no batches after that, and gives it once. value is 2/N
        times it."""
        if self._read:
            raise RuntimeError("this Hessian's sum was read already")
        if self._pending is not None:
            self._flush()
            self._pending = self._tiles = None
        assert self.sum is not None, "no calibration batch reached this Linear"
        self.tokens = all_reduce_count(self.tokens)  # now of every process: their sums add up
        G, self.sum, self._read = mirror_triangle_(all_reduce_(self.sum)), None, True
        return G


@functools.cache
def _mixed_gram_on(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        x = torch.ones(8, 8, dtype=dtype, device=device)
        return bool(torch.mm(x.t(), x, out_dtype=torch.float32).eq(8).all())
    except (RuntimeError, TypeError, NotImplementedError):  # torch before 2.8, or a backend without it
        return False


def mixed_gram_available(x: Tensor) -> bool:
    """Whether xᵀx of x (bf16 or fp16, on a GPU) runs as one GEMM of x's dtype with float32
    output (torch.mm's out_dtype): products of bf16 or fp16 values are exact in float32 and
    the tensor cores add them up in float32. Measured on an H200 (torch 2.11, 16384 tokens
    of 4096 features, scripts/gpu_gptq_8b.py): relative error 2.1e-5 against float64 sums,
    where a CPU's float32 GEMM of the same values gives 2.9e-7 and bf16 output 1.9e-3, far
    below GPTQ's 1% dampening; one batch of 16384 x 14336 took 6.0 ms against 67.1 ms as
    float32 GEMMs (CUDA cores); the Llama-3-8B-shaped GPTQ took 10.6 s a layer over 4 layers
    with it, 13.8 s a layer over 8 before (the passes beside the solves: 5.5 against 8.8 s)."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cuda" and _mixed_gram_on(x.device, x.dtype)


def _bf16_valued(x: Tensor) -> bool:
    """Whether x xᵀ runs as bf16-valued GEMMs (see HessianObserver)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and bf16_valued_gemms_exact()


class AbsMaxObserver(Observer):
    """max |x| per input channel: float32 [in]."""

    def __init__(self) -> None:
        self.max: Tensor | None = None
        self._reduced = False

    def update(self, x: Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1])
        current = compiled.abs_column_stat(flat, "max")  # the same values, one pass
        if current is None:
            current = flat.abs().amax(dim=0).float()
        self.max = current if self.max is None else torch.maximum(self.max, current)

    @property
    def value(self) -> Tensor:
        assert self.max is not None, "no calibration batch reached this Linear"
        if not self._reduced:
            self.max, self._reduced = all_reduce_(self.max, "max"), True
        return self.max

    def updates_alone(self, features: int, dtype: torch.dtype) -> bool:
        return True  # one pass over the inputs on the calling thread


class MeanAbsObserver(Observer):
    """mean |x| per input channel: float32 [in]."""

    def __init__(self) -> None:
        self.sum: Tensor | None = None
        self.tokens = 0
        self._reduced = False

    def update(self, x: Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1])
        current = compiled.abs_column_stat(flat, "sum")  # one pass, its sums in one order
        if current is None:
            current = flat.abs().float().sum(dim=0)
        self.sum = current if self.sum is None else self.sum + current
        self.tokens += flat.shape[0]

    @property
    def value(self) -> Tensor:
        assert self.sum is not None, "no calibration batch reached this Linear"
        if not self._reduced:
            self.sum, self.tokens, self._reduced = all_reduce_(self.sum), all_reduce_count(self.tokens), True
        return self.sum / self.tokens

    def updates_alone(self, features: int, dtype: torch.dtype) -> bool:
        return True  # one pass over the inputs on the calling thread


class Observers(Observer):
    """Several observers fed the same inputs: value is a dict of their values by name."""

    def __init__(self, **observers: Observer) -> None:
        self.observers = observers

    def update(self, x: Tensor) -> None:
        for observer in self.observers.values():
            observer.update(x)

    @property
    def value(self) -> dict[str, Tensor]:
        return {name: observer.value for name, observer in self.observers.items()}

    def updates_alone(self, features: int, dtype: torch.dtype) -> bool:
        return all(observer.updates_alone(features, dtype) for observer in self.observers.values())
