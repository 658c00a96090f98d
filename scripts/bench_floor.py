"""The least time a GPTQ W4A16 job can take on this machine: every FLOP at its measured rate.

Used by scripts/bench_gptq_vs_llmcompressor.py. The job, per block and calibration token:

- forward: one pass of the block's Linears (q, k, v, o, gate, up, down) and attention
  (scores and weighted sum over the keys at or before each query, (seq + 1) / 2 on
  average: causal attention needs no more, and ptq's compiled attention computes about
  that, in blocks of 8 queries; at the faster of one GEMM per head and sample and one bmm
  for a batch's, full-size), in
  the compute dtype ptq picks here, at that dtype's GEMM rate on the model's own shapes;
- Hessians: the four shared Hessians (q/k/v, o, gate/up, down), blocks on and above the
  diagonal as ptq accumulates them, to float32 accuracy: at the float32 GEMM rate, or at
  the bf16 rate where ptq multiplies bf16 values in bf16 with float32 sums (oneDNN's
  float32 GEMMs of bf16 values, or ptq's compiled sums on AMX tiles or with VDPBF16PS;
  the faster counts);

and per solved weight [out, in] (q/k/v stacked, o, gate/up stacked, down):

- Cholesky of the [in, in] Hessian, in³/3 FLOPs, at potrf's rate on that size, and the
  inverse of the triangular factor, in³/3 FLOPs, at the triangular-solve rate on that size;
  or both at the rate of ptq's compiled factorisation on that size (linalg.c, where it
  runs: the size at most cholesky.compiled_rows(), its Cholesky's updates and its
  inverse's tiles on all from compiled.INVERSE_ROWS rows; above, its compiled blocks on all
  threads where the compiled GEMM runs), whichever is faster;
- the column loop: rank-1 updates inside each block of B columns (out·in·B FLOPs, at
  addr's rate on [B, out] rows) and the lazy updates after each block (out·in² FLOPs, at
  the faster of the float32 GEMM's rate on [in, B] @ [B, out] and ptq's compiled GEMM's,
  compiled.gemm_subtract, on all threads, the output's columns split between them).

ptq's compiled loop does the rank-1 updates in its own code (gptq_loop.c), which may run
faster than torch's addr: that part of the floor is the one not at the machine's best rate.

Rounding, the scale search, loading and saving come on top. Each rate is the best of a
few timed runs, with torch's default thread count (the floor does not pin Cholesky to one
thread as ptq does for reproducibility: it is the machine's best).
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

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
    """GFLOP/s of each kind of operation, measured here on given shapes, cached.

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

    def factorisation(self, n: int) -> float:
        """ptq's compiled Cholesky and inverse of its factor on [n, n], as 2n³/3 FLOPs: in one
        piece (linalg.c: the Cholesky's updates from compiled.CHOLESKY_ROWS rows and the
        inverse's tiles from compiled.INVERSE_ROWS rows on all threads) up to
        cholesky.compiled_rows() rows, above in compiled
        blocks on all threads (cholesky.blocked_inverse_cholesky_, where the compiled GEMM
        runs); 0 where neither runs."""
        from ptq.algorithms import cholesky, compiled

        def positive_definite() -> torch.Tensor:
            x = torch.randn(n, 2 * n)
            return x @ x.t() / n + torch.eye(n)  # [n, n]

        def make_whole():
            H = positive_definite()
            diag = H.diagonal().clone()
            return lambda: compiled.inverse_cholesky(H, diag, threads=torch.get_num_threads())

        if n <= cholesky.compiled_rows():
            return self._rate(("compiled factorisation", n), 2 * n**3 / 3, make_whole)
        if not cholesky.compiled_blocks(torch.empty(0)):
            return 0.0
        def make_blocks():  # it factors in place: a fresh copy each call
            H, A = positive_definite(), torch.empty(n, n)
            return lambda: A.copy_(H), lambda: cholesky.blocked_inverse_cholesky_(A, torch.get_num_threads())

        return self._rate_in_place(("compiled blocks", n), 2 * n**3 / 3, make_blocks)

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
            x = torch.randn(block, 2 * block)
            L = torch.linalg.cholesky(torch.linalg.inv(x @ x.t() / block + torch.eye(block)))
            Hinv = L.t().contiguous()  # [block, block] upper, as GPTQ's
            W = torch.randn(block, out) * 0.05  # [block, out]: the working weight, transposed
            Wt, E, Qt = torch.empty_like(W), torch.empty(block, out), torch.empty(block, out, dtype=torch.int8)
            scale = torch.empty(1, out)  # [groups, out]: held here, the loop keeps only its address
            args = QuantArgs(num_bits=4, strategy="group", group_size=block)
            members, group = _group_layout(block, args, "none", None)  # one group, fitted at position 0
            first = torch.full((block,), -1, dtype=torch.long)
            first[0] = 0
            loop = BlockLoop(Wt, Hinv, E, Qt, group, first, members, torch.ones(block), scale, None, args,
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


@dataclass
class Floor:
    forward: float  # seconds of each part
    hessians: float
    factorisation: float  # Cholesky and the inverse of its factor
    loop: float
    tflop: float  # all parts
    solves_tflop: float  # the factorisations and column loops alone

    @property
    def seconds(self) -> float:
        return self.forward + self.hessians + self.factorisation + self.loop

    @property
    def solves(self) -> float:
        """Seconds of GPTQ's solves alone: the factorisations and the column loops."""
        return self.factorisation + self.loop

    def parts(self) -> str:
        return (f"forward {self.forward:.2f} + Hessians {self.hessians:.2f} + Cholesky and inverse "
                f"{self.factorisation:.2f} + column loop {self.loop:.2f} s")


def transformers_forward(path, ids: torch.Tensor, repeats: int = 2) -> float:
    """Seconds of a plain forward pass of the model's decoder (transformers' own code, no
    hooks, nothing recorded) over the calibration token ids [samples, seq], in the compute
    dtype ptq picks here, in ptq's calibration batches side by side as its passes run them:
    best of `repeats`. Beside the floor's forward (the Linears and attention at GEMM rates)
    it shows what transformers' glue between them costs (norms, rotary, activations,
    residual adds, copies), which every calibration pass pays and the floor does not count."""
    import ptq
    from ptq.calibration.runner import batch_size_for
    from ptq.devices import compute_dtype_for, map_side_by_side

    model, _ = ptq.load_model(str(path))
    decoder = getattr(model, "model", model).to(compute_dtype_for("cpu", torch.bfloat16)).eval()
    batches = ids.split(batch_size_for(ids.shape[0], ids.shape[1], "cpu"))
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in map_side_by_side(lambda batch: decoder(input_ids=batch, use_cache=False), batches, "cpu",
                                      bounded=True):
                pass
            best = min(best, time.perf_counter() - start)
    return best


def hessian_macs(n: int, tiles: bool = False) -> float:
    """MACs per token of one Hessian [n, n], blocks on and above the diagonal as ptq
    accumulates them (tiles: on AMX tiles, in smaller blocks)."""
    from ptq.calibration.observers import HessianObserver

    return HessianObserver.macs(n, tiles)


def floor_of(config, samples: int, seq: int, rates: Rates, compiled_solves: bool = True) -> Floor:
    """The floor of GPTQ W4A16 on a model of this transformers config, on samples x seq tokens.
    compiled_solves=False leaves ptq's compiled factorisation and GEMM out of the solves'
    rates (LAPACK's and torch's alone: the floor as runs before they existed measured it)."""
    from ptq.algorithms import compiled
    from ptq.devices import bf16_valued_gemms_exact, compute_dtype_for

    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    tokens = samples * seq
    dtype = compute_dtype_for("cpu", torch.bfloat16)
    m = min(tokens, 2048)  # rows of the GEMMs timed (a few batches' tokens)
    # attention's products [seq, head] @ [head, seq]: one at a time, or all of a batch's heads
    # and samples in one bmm, whichever is faster here (on 256-token samples one at a time
    # measured 137 to 251 GFLOP/s from run to run, the bmm 840 to 900; on 512-token samples
    # of 64-wide heads the bmm is the slower)
    attention_rate = max(rates.gemm(seq, head, seq, dtype),
                         rates.bmm(config.num_attention_heads * max(1, m // seq), seq, head, seq, dtype))
    forward = 2 * tokens * layers * (  # FLOPs at the GEMM rate of each Linear's shape
        h * (q + 2 * kv) / rates.gemm(m, h, q + 2 * kv, dtype) + q * h / rates.gemm(m, q, h, dtype)
        + 2 * h * i / rates.gemm(m, h, 2 * i, dtype) + i * h / rates.gemm(m, i, h, dtype)
        + (seq + 1) * q / attention_rate)  # scores and weighted sum, causal: (seq + 1) / 2 keys each
    flops = 2 * tokens * layers * (h * (q + 2 * kv) + q * h + 3 * h * i + (seq + 1) * q)

    def tiles(n: int) -> bool:  # ptq sums bf16 inputs with its compiled Gram kernel here
        return dtype == torch.bfloat16 and n % 32 == 0 and compiled.gram_kernel() is not None

    def hessian_seconds(n: int) -> float:
        rate = rates.gemm(n, m, n, torch.float32)
        if dtype == torch.bfloat16 and (bf16_valued_gemms_exact() or tiles(n)):
            rate = max(rate, rates.gemm(n, m, n, torch.bfloat16))
        return 2 * tokens * hessian_macs(n, tiles(n)) / rate

    hessians = layers * (3 * hessian_seconds(h) + hessian_seconds(i))  # qkv, o, gate/up share h-sized ones
    flops += 2 * tokens * layers * (3 * hessian_macs(h, tiles(h)) + hessian_macs(i, tiles(i)))
    factorisation = loop = solve_flops = 0.0
    for out, n in solved_weights(config):
        lapack = n**3 / 3 / rates.cholesky(n) + n**3 / 3 / rates.triangular_inverse(n)
        compiled_rate = rates.factorisation(n) if compiled_solves else 0.0
        factorisation += layers * (min(lapack, 2 * n**3 / 3 / compiled_rate) if compiled_rate else lapack)
        lazy_rate = rates.gemm(n, BLOCK, out, torch.float32)
        if compiled_solves:
            lazy_rate = max(lazy_rate, rates.compiled_gemm(n, BLOCK, out))
        rank1_rate = rates.rank1(out)
        if compiled_solves:
            rank1_rate = max(rank1_rate, rates.compiled_block(out))
        loop += layers * (out * n * BLOCK / rank1_rate + out * n * n / lazy_rate)
        solve_flops += layers * (2 * n**3 / 3 + out * n * (BLOCK + n))
    return Floor(forward / 1e9, hessians / 1e9, factorisation / 1e9, loop / 1e9, (flops + solve_flops) / 1e12,
                 solve_flops / 1e12)


def solved_weights(config) -> list[tuple[int, int]]:
    """[out, in] of each weight GPTQ solves in a block: q/k/v stacked, o, gate/up stacked, down."""
    h, i = config.hidden_size, config.intermediate_size
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def awq_balanced_weights(config) -> list[tuple[int, int]]:
    """[out, in] of the stacked balance Linears of each AWQ smoothing mapping ptq uses in a
    block of this config's model (ptq.arch.block_mappings on a one-block copy, randomly
    initialised: the norms' fold check probes real values)."""
    import transformers

    from ptq.arch import block_mappings, find_blocks

    one_block = copy.deepcopy(config)
    one_block.num_hidden_layers = 1
    model = transformers.AutoModelForCausalLM.from_config(one_block)
    mappings, _ = block_mappings(model, find_blocks(model)[1][0])
    return [(sum(linear.out_features for linear in m.balance), m.channels) for m in mappings]


@dataclass
class SearchFloor:
    seconds: float
    tflop: float


def awq_search_floor(config, rates: Rates, n_grid: int = 20) -> SearchFloor:
    """The least time of ptq's AWQ search with the linear loss (the default): for each
    mapping, 1 + n_grid candidates (s = 1 and the grid), each ΔW G ΔWᵀ over the stacked
    balance weights, at the rate of ptq's compiled quadratic form on that shape (half a
    GEMM's multiply-adds: G is symmetric), or of a float32 GEMM where that does not run.
    The candidates' weights (a rounding of W·diag(s) each) come on top."""
    seconds = flop_total = 0.0
    for out, n in awq_balanced_weights(config):
        rate = rates.quadratic_form(out, n)
        flops = config.num_hidden_layers * (1 + n_grid) * (out * n * (n + 32) if rate else 2 * out * n * n)
        seconds += flops / (rate or rates.gemm(out, n, n, torch.float32)) / 1e9
        flop_total += flops
    return SearchFloor(seconds, flop_total / 1e12)
