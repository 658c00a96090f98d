"""Rates of the operations a quantization job is made of, timed on this machine on given shapes.

Used by scripts/bench_floor.py (the least time of a GPTQ job) and through it by
scripts/bench_gptq_vs_llmcompressor.py. Each rate is the best of a few timed runs, with
torch's default thread count; a Rates object caches them and can time them all again,
keeping the faster (remeasure)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

BLOCK = 128  # GPTQ's block of columns (ptq's and llm-compressor's default)


def best_seconds(fn: Callable[[], object], repeats: int = 5, min_seconds: float = 0.05) -> float:
    """Best time of one call over `repeats` timings, each long enough to measure, after as
    long a warm-up (oneDNN settles on its kernel for a shape over the first calls: a bmm
    timed after one warm-up call measured 162 GFLOP/s, after more 1060). Five timings, not
    three: in one run three GEMM shapes measured 410 GFLOP/s against 750 in the run before
    (the other core taken for a moment), which raised the floor by 40%."""
    start = time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        fn()
    best = float("inf")
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < min_seconds or calls == 0:
            fn()
            calls += 1
        best = min(best, elapsed / calls)
    return best


class Rates:
    """GFLOP/s of each kind of operation (G elements/s of the element-wise ones), measured
    here on given shapes, cached.

    remeasure() times every cached one again and keeps the faster of the two: a rate timed
    while the VM was slowed for a moment raises the floor (one run measured 196 and 200
    GFLOP/s for two bf16 GEMM shapes of the random model, 343-363 for its others, and put
    ptq's quantize at 0.89x a floor that was none; the same shapes measured 342-375 minutes
    later). A floor is the best the machine does, so each rate is the best seen."""

    def __init__(self) -> None:
        self.cache: dict[tuple, float] = {}
        self._timings: dict[tuple, Callable[[], float]] = {}  # key -> a new timing of its rate

    def _rate(self, key: tuple, flops: float, make: Callable[[], Callable[[], object]]) -> float:
        return self._cached(key, lambda: flops / best_seconds(make()) / 1e9)

    def _rate_in_place(self, key: tuple, flops: float, make: Callable[[], tuple[Callable, Callable]]) -> float:
        """_rate of an operation that consumes its input: make() gives (reset, run); each
        timed call resets the input first, and the reset's own time is taken off."""
        def timing() -> float:
            reset, run = make()
            both = best_seconds(lambda: (reset(), run()))
            return flops / max(both - best_seconds(reset), 1e-9) / 1e9
        return self._cached(key, timing)

    def _cached(self, key: tuple, timing: Callable[[], float]) -> float:
        if key not in self.cache:
            self._timings[key] = timing
            self.cache[key] = timing()
        return self.cache[key]

    def remeasure(self) -> list[tuple]:
        """Time every cached rate again, keep the faster; return the keys whose two timings
        differ by more than 10%."""
        moved = []
        for key, timing in self._timings.items():
            again = timing()
            if abs(again - self.cache[key]) > 0.1 * max(again, self.cache[key]):
                moved.append(key)
            self.cache[key] = max(self.cache[key], again)
        return moved

    def gemm(self, m: int, k: int, n: int, dtype: torch.dtype) -> float:
        def make():
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)  # [m, k], [k, n]
            return lambda: a @ b
        return self._rate(("gemm", m, k, n, dtype), 2 * m * k * n, make)

    def bmm(self, batch: int, m: int, k: int, n: int, dtype: torch.dtype) -> float:
        """batch GEMMs [m, k] @ [k, n] in one call (attention's heads and samples)."""
        def make():
            a, b = torch.randn(batch, m, k).to(dtype), torch.randn(batch, k, n).to(dtype)
            return lambda: torch.bmm(a, b)
        return self._rate(("bmm", batch, m, k, n, dtype), 2 * batch * m * k * n, make)

    def cholesky(self, n: int) -> float:
        def make():
            x = torch.randn(n, 2 * n)
            H = x @ x.t() / n + torch.eye(n)  # [n, n] positive definite
            return lambda: torch.linalg.cholesky_ex(H)
        return self._rate(("cholesky", n), n**3 / 3, make)

    def triangular_inverse(self, n: int) -> float:
        def make():
            x = torch.randn(n, 2 * n)
            L = torch.linalg.cholesky(x @ x.t() / n + torch.eye(n))  # [n, n] lower
            eye = torch.eye(n)
            return lambda: torch.linalg.solve_triangular(L, eye, upper=False)
        return self._rate(("trinv", n), n**3 / 3, make)  # as a triangular inverse: zeros above skipped

    def compiled_cholesky(self, n: int) -> float:
        """ptq's compiled Cholesky of [n, n] (the part of GPTQ's factorisation that counts:
        cholesky.feedback's copy of the factor is n² moves), as n³/3 FLOPs: in one piece
        (linalg.c: its updates from compiled_cholesky.CHOLESKY_ROWS rows on all threads) up to
        cholesky.compiled_rows() rows, above in compiled blocks on all threads
        (cholesky.blocked_cholesky_, where the compiled GEMM runs); 0 where neither runs."""
        from ptq.algorithms import cholesky, compiled_cholesky

        if n <= cholesky.compiled_rows():
            def make_whole():
                H = _positive_definite(n)
                diag = H.diagonal().clone()
                return lambda: compiled_cholesky.cholesky(H, diag, threads=torch.get_num_threads())

            return self._rate(("compiled cholesky", n), n**3 / 3, make_whole)
        if not cholesky.compiled_blocks(torch.empty(0)):
            return 0.0

        def make_blocks():  # it factors in place: a fresh copy each call
            H, A = _positive_definite(n), torch.empty(n, n)
            return lambda: A.copy_(H), lambda: cholesky.blocked_cholesky_(A, torch.get_num_threads())

        return self._rate_in_place(("compiled blocks", n), n**3 / 3, make_blocks)

    def compiled_inverse(self, n: int) -> float:
        """ptq's compiled inverse of a Cholesky factor of [n, n]
        (compiled_cholesky.inverse_of_factor: its tiles on all threads from
        compiled_cholesky.INVERSE_ROWS rows), as n³/3 FLOPs, up to
        cholesky.compiled_rows() rows; 0 above or where it does not run. Only for the floor as
        the issue first defined it (GPTQ with H⁻¹'s factor; ptq's factorisation no longer
        inverts anything)."""
        from ptq.algorithms import cholesky, compiled_cholesky

        if n > cholesky.compiled_rows():
            return 0.0

        def make():
            H = _positive_definite(n)
            A = compiled_cholesky.cholesky(H, H.diagonal().clone())
            return lambda: compiled_cholesky.inverse_of_factor(A, n, threads=torch.get_num_threads())

        return self._rate(("compiled inverse", n), n**3 / 3, make)

    def compiled_gemm(self, m: int, k: int, n: int) -> float:
        """ptq's compiled C -= A @ B (compiled.gemm_subtract), [m, k] @ [k, n] float32, the
        columns of C split over torch's threads as the column loop splits the weight's rows
        (gptq_compiled.row_slices); 0 where it does not run (no AVX-512)."""
        from ptq.algorithms import compiled
        from ptq.algorithms.gptq_compiled import row_slices
        from ptq.devices import cpu_parallel

        if not compiled.gemm_available():
            return 0.0

        def make():
            C, A, B = torch.randn(m, n), torch.randn(m, k), torch.randn(k, n)
            slices = row_slices(n, torch.get_num_threads())
            tasks = [functools.partial(compiled.gemm_subtract, C[:, a:b], A, B[:, a:b]) for a, b in slices]
            return lambda: cpu_parallel(tasks, len(tasks))
        return self._rate(("compiled gemm", m, k, n), 2 * m * k * n, make)

    def quadratic_form(self, rows: int, n: int) -> float:
        """ptq's compiled Σ_r d_r G d_rᵀ (compiled.QuadraticForm: the linear loss of one AWQ
        candidate, D [rows, n] bf16) as AWQ's search runs it: one candidate per thread, all
        threads side by side, as rows·n·(n + 32) FLOPs each (the 32 x 32 blocks of G on and
        above the diagonal); 0 where it does not run (no AMX or AVX512-BF16, or a size not a
        multiple of 32)."""
        from ptq.algorithms import compiled
        from ptq.devices import cpu_parallel

        threads = torch.get_num_threads()
        if compiled.gram_kernel() is None or rows % 32 or n % 32:
            return 0.0

        def make():
            x = torch.randn(2 * n, n)
            form = compiled.QuadraticForm(x.t() @ x / n)
            D = [torch.randn(rows, n).to(torch.bfloat16) for _ in range(threads)]
            tasks = [functools.partial(form.of, d) for d in D]
            return lambda: cpu_parallel(tasks, threads)
        return self._rate(("quadratic form", rows, n), threads * rows * n * (n + 32), make)

    def compiled_block(self, out: int, block: int = BLOCK) -> float:
        """ptq's compiled column loop (gptq_compiled.BlockLoop: gptq_loop.c) over one block of
        `block` columns of a weight of `out` rows, the rows split over torch's threads as in a
        solve, as out·block² FLOPs (the updates inside the block, as rank1 counts them); its
        time includes each column's rounding (a min-max range per group of `block` columns),
        work the job needs that the floor otherwise leaves out. 0 where the compiled loop does
        not run (torch's loop there: addr's rate is its rate)."""
        from ptq.algorithms import compiled
        from ptq.algorithms.gptq import _group_layout
        from ptq.algorithms.gptq_compiled import BlockLoop
        from ptq.schemes import QuantArgs

        if compiled.unavailable():
            return 0.0

        def make():
            from ptq.algorithms.cholesky import feedback

            F = feedback(_positive_definite(block), 0.01)[0]  # [block, block] upper, as GPTQ's
            W = torch.randn(block, out) * 0.05  # [block, out]: the working weight, transposed
            Wt, Qt = torch.empty_like(W), torch.empty(block, out, dtype=torch.int8)
            scale = torch.empty(1, out)  # [groups, out]: held here, the loop keeps only its address
            args = QuantArgs(num_bits=4, strategy="group", group_size=block)
            members, group = _group_layout(block, args, "none", None)  # one group, fitted at position 0
            first = torch.full((block,), -1, dtype=torch.long)
            first[0] = 0
            loop = BlockLoop(Wt, W, F, Qt, group, first, members, torch.ones(block), scale, None, args,
                             torch.bfloat16, "minmax", torch.get_num_threads())
            keep = (Qt, scale)  # alive while the loop writes them
            return lambda: Wt.copy_(W), lambda: (keep, loop.solve(block))  # it consumes its weight

        return self._rate_in_place(("compiled block", out, block), out * block * block, make)

    def rank1(self, out: int, block: int = BLOCK) -> float:
        """addr_ on block / 2 rows of [out]: the column loop's update inside a block, on average."""
        def make():
            W, h, e = torch.randn(block // 2, out), torch.randn(block // 2), torch.randn(out)  # [block/2, out]
            return lambda: W.addr_(h, e, alpha=-1)
        return self._rate(("addr", out, block), block * out, make)

    def elementwise(self, kind: str, tool: str, rows: int, n: int, dtype: torch.dtype) -> float:
        """G elements/s (of its output) of one of the element-wise ops between a Llama block's
        Linears on [rows, n] tensors of dtype: kind "norm" (RMSNorm with a weight), "add" (a
        residual add) or "silu_mul" (silu(gate) · up); tool "torch" (F.rms_norm, +,
        F.silu(gate) * up) or "ptq" (its compiled norm and product: ptq.cpu_norm, ptq.cpu_mlp),
        0 where ptq's does not run on such tensors here (bf16 on AVX-512 only)."""
        from ptq import cpu_mlp, cpu_norm

        probe = torch.zeros(1, n, dtype=dtype)  # [1, n]: whether ptq's code takes such rows
        runs = {"norm": lambda: cpu_norm.lanes() is not None,
                "silu_mul": lambda: cpu_mlp.silu_mul(probe, probe) is not None}
        if tool == "ptq" and not (dtype == torch.bfloat16 and kind in runs and runs[kind]()):
            return 0.0

        def make():
            x, y = torch.randn(rows, n).to(dtype), torch.randn(rows, n).to(dtype)
            weight = torch.rand(n).to(dtype) + 0.5
            return {
                ("norm", "torch"): lambda: torch.nn.functional.rms_norm(x, (n,), weight, 1e-6),
                ("norm", "ptq"): lambda: cpu_norm.rms_norm(x, weight, 1e-6),
                ("add", "torch"): lambda: x + y,
                ("silu_mul", "torch"): lambda: torch.nn.functional.silu(x) * y,
                ("silu_mul", "ptq"): lambda: cpu_mlp.silu_mul(x, y),
            }[kind, tool]
        return self._rate(("elementwise", kind, tool, rows, n, dtype), rows * n, make)

    def rotary(self, tool: str, batch: int, heads: int, seq: int, dim: int, dtype: torch.dtype) -> float:
        """G elements/s of rotary embeddings, x · cos + rotate_half(x) · sin as transformers'
        Llama code computes them, on x [batch, heads, seq, dim] of dtype: tool "torch" (that
        code) or "ptq" (ptq.cpu_rotary), 0 where ptq's does not run here."""
        from ptq import cpu_rotary

        if tool == "ptq" and cpu_rotary.rotary(torch.zeros(1, 1, 1, dim, dtype=dtype),
                                               *torch.zeros(2, 1, 1, dim, dtype=dtype)) is None:
            return 0.0

        def make():
            x = torch.randn(batch, heads, seq, dim).to(dtype)
            cos, sin = torch.randn(1, seq, dim).to(dtype), torch.randn(1, seq, dim).to(dtype)
            if tool == "ptq":
                return lambda: cpu_rotary.rotary(x, cos, sin)
            half = dim // 2
            return lambda: x * cos.unsqueeze(1) + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.unsqueeze(1)
        return self._rate(("rotary", tool, batch, heads, seq, dim, dtype), batch * heads * seq * dim, make)

    def attention(self, tool: str, batch: int, heads: int, kv_heads: int, seq: int, dim: int,
                  dtype: torch.dtype) -> float:
        """GFLOP/s of causal attention, softmax(q kᵀ / √dim) v with the softmax, on q [batch,
        heads, seq, dim] and k, v [batch, kv_heads, seq, dim] of dtype, counted as its products
        over the keys at or before each query ((seq + 1) / 2 on average): tool "torch"
        (F.scaled_dot_product_attention, causal, the key-value heads shared) or "ptq"
        (ptq.cpu_attention.causal_attention), 0 where ptq's does not run here."""
        from ptq import cpu_attention

        if tool == "ptq" and not (cpu_attention.available(dtype) and dim % cpu_attention.HEAD_MULTIPLE[dtype] == 0):
            return 0.0

        def make():
            q = torch.randn(batch, heads, seq, dim).to(dtype)
            k, v = torch.randn(batch, kv_heads, seq, dim).to(dtype), torch.randn(batch, kv_heads, seq, dim).to(dtype)
            scale = dim**-0.5
            if tool == "ptq":
                return lambda: cpu_attention.causal_attention(q, k, v, scale)
            return lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
        flops = 2 * batch * heads * seq * (seq + 1) * dim  # two products, (seq + 1) / 2 keys a query
        return self._rate(("attention", tool, batch, heads, kv_heads, seq, dim, dtype), flops, make)


def _positive_definite(n: int) -> torch.Tensor:
    """A random [n, n] symmetric positive definite matrix, as far from diagonal as a Hessian."""
    x = torch.randn(n, 2 * n)
    return x @ x.t() / n + torch.eye(n)
