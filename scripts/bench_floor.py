"""The least time a GPTQ W4A16 job can take on this machine: all its work at measured rates.

Used by scripts/bench_gptq_vs_llmcompressor.py. The job, per block and calibration token:

- Linears: one pass of the block's Linears (q, k, v, o, gate, up, down), in the compute
  dtype ptq picks here, at that dtype's GEMM rate on the model's own shapes;
- attention: its products over the keys at or before each query ((seq + 1) / 2 on
  average: causal attention needs no more, and ptq's compiled attention computes about
  that, in blocks of 8 queries) and the softmax between them, at the rate of the faster of
  torch's scaled_dot_product_attention and ptq's compiled attention on one batch;
- glue: the element-wise work between the Linears, each kind at the rate of the faster of
  torch's op and ptq's compiled one on one batch: two RMSNorms and two residual adds of the
  hidden state, rotary embeddings of the queries and keys, the SiLU-gated product (the
  forward: these three parts);
- Hessians: the four shared Hessians (q/k/v, o, gate/up, down), blocks on and above the
  diagonal as ptq accumulates them, to float32 accuracy: at the float32 GEMM rate, or at
  the bf16 rate where ptq multiplies bf16 values in bf16 with float32 sums (oneDNN's
  float32 GEMMs of bf16 values, or ptq's compiled sums on AMX tiles or with VDPBF16PS;
  the faster counts);

and per solved weight [out, in] (q/k/v stacked, o, gate/up stacked, down):

- Cholesky of the [in, in] Hessian, in³/3 FLOPs, at the faster of potrf's rate on that
  size and ptq's compiled Cholesky's (linalg.c, where it runs: the size at most
  cholesky.compiled_rows(), its updates on all threads from compiled_cholesky.CHOLESKY_ROWS rows;
  above, its compiled blocks on all threads where the compiled GEMM runs). GPTQ as the
  paper writes it also inverts the factor (another in³/3): ptq's feedback form needs no
  inverse (ptq.algorithms.cholesky), so the floor leaves it out; floor_of(inverse=True)
  counts it (the issue's first wording of the floor, and every run up to code 7ec4c68),
  at the faster of the triangular-solve rate and ptq's compiled inverse's;
- the column loop: rank-1 updates inside each block of B columns (out·in·B FLOPs, at
  addr's rate on [B, out] rows) and the lazy updates after each block (out·in² FLOPs, at
  the faster of the float32 GEMM's rate on [in, B] @ [B, out] and ptq's compiled GEMM's,
  compiled.gemm_subtract, on all threads, the output's columns split between them).

ptq's compiled loop does the rank-1 updates in its own code (gptq_loop.c), which may run
faster than torch's addr: that part of the floor is the one not at the machine's best rate.

The floor of runs before the glue was counted (floor_of(glue=False)) had no glue part and
counted attention's products alone, at the faster of one GEMM per head and sample and one
bmm for a batch's, full-size: the softmax left out. Rounding, the scale search, the
embedding, copies, loading and saving come on top. Each rate is the best of a
few timed runs, with torch's default thread count (the floor does not pin Cholesky to one
thread as ptq does for reproducibility: it is the machine's best).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from bench_rates import BLOCK, Rates


@dataclass
class Floor:
    linears: float  # seconds of each part
    attention: float
    glue: float
    hessians: float
    factorisation: float  # Cholesky (and with inverse=True, the inverse of its factor)
    loop: float
    tflop: float  # all parts but the glue (element-wise: counted in elements, by its time)
    solves_tflop: float  # the factorisations and column loops alone

    @property
    def forward(self) -> float:
        """Seconds of the forward pass: the Linears, attention and the glue between them."""
        return self.linears + self.attention + self.glue

    @property
    def seconds(self) -> float:
        return self.forward + self.hessians + self.factorisation + self.loop

    @property
    def solves(self) -> float:
        """Seconds of GPTQ's solves alone: the factorisations and the column loops."""
        return self.factorisation + self.loop

    def parts(self) -> str:
        glue = f" + glue {self.glue:.2f}" if self.glue else ""
        return (f"Linears {self.linears:.2f} + attention {self.attention:.2f}{glue} + Hessians {self.hessians:.2f}"
                f" + Cholesky {self.factorisation:.2f} + column loop {self.loop:.2f} s")


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


def floor_of(config, samples: int, seq: int, rates: Rates, compiled_solves: bool = True, glue: bool = True,
             inverse: bool = False) -> Floor:
    """The floor of GPTQ W4A16 on a model of this transformers config, on samples x seq tokens.
    compiled_solves=False leaves ptq's compiled factorisation and GEMM out of the solves'
    rates (LAPACK's and torch's alone: the floor as runs before they existed measured it);
    glue=False leaves out the glue and attention's softmax (the floor before they counted);
    inverse=True adds the inverse of each Cholesky factor (the floor before ptq's GPTQ
    stopped inverting: the issue's wording)."""
    from ptq.algorithms import compiled
    from ptq.devices import bf16_valued_gemms_exact, compute_dtype_for

    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads, head = attention_heads(config)
    q, kv = heads * head, kv_heads * head
    tokens = samples * seq
    dtype = compute_dtype_for("cpu", torch.bfloat16)
    m = min(tokens, 2048)  # rows of the GEMMs timed (a few batches' tokens)
    batch = max(1, m // seq)  # samples in one batch of the attention and the glue timed
    linears = 2 * tokens * layers * (  # FLOPs at the GEMM rate of each Linear's shape
        h * (q + 2 * kv) / rates.gemm(m, h, q + 2 * kv, dtype) + q * h / rates.gemm(m, q, h, dtype)
        + 2 * h * i / rates.gemm(m, h, 2 * i, dtype) + i * h / rates.gemm(m, i, h, dtype))
    attention_flops = 2 * tokens * layers * (seq + 1) * q  # scores and weighted sum, causal: (seq + 1) / 2 keys each
    if glue:  # products and softmax: the faster whole attention
        attention_rate = max(rates.attention(tool, batch, heads, kv_heads, seq, head, dtype)
                             for tool in ("torch", "ptq"))
    else:  # products alone: one at a time, or all of a batch's heads and samples in one bmm (on
        # 256-token samples one at a time measured 137 to 251 GFLOP/s from run to run, the
        # bmm 840 to 900; on 512-token samples of 64-wide heads the bmm is the slower)
        attention_rate = max(rates.gemm(seq, head, seq, dtype), rates.bmm(heads * batch, seq, head, seq, dtype))
    attention = attention_flops / attention_rate
    glue_seconds = tokens * layers * glue_per_token(config, rates, batch, seq, dtype) if glue else 0.0
    flops = 2 * tokens * layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + attention_flops

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
        cholesky_rate = max(rates.cholesky(n), rates.compiled_cholesky(n) if compiled_solves else 0.0)
        factorisation += layers * n**3 / 3 / cholesky_rate
        if inverse:
            inverse_rate = max(rates.triangular_inverse(n), rates.compiled_inverse(n) if compiled_solves else 0.0)
            factorisation += layers * n**3 / 3 / inverse_rate
            solve_flops += layers * n**3 / 3
        lazy_rate = rates.gemm(n, BLOCK, out, torch.float32)
        if compiled_solves:
            lazy_rate = max(lazy_rate, rates.compiled_gemm(n, BLOCK, out))
        rank1_rate = rates.rank1(out)
        if compiled_solves:
            rank1_rate = max(rank1_rate, rates.compiled_block(out))
        loop += layers * (out * n * BLOCK / rank1_rate + out * n * n / lazy_rate)
        solve_flops += layers * (n**3 / 3 + out * n * (BLOCK + n))
    return Floor(linears / 1e9, attention / 1e9, glue_seconds, hessians / 1e9, factorisation / 1e9, loop / 1e9,
                 (flops + solve_flops) / 1e12, solve_flops / 1e12)


def glue_per_token(config, rates: Rates, batch: int, seq: int, dtype: torch.dtype) -> float:
    """Seconds of the glue per token and block (see the module's docstring), each kind at the
    faster of torch's and ptq's rate on one batch of batch x seq tokens."""
    h, i = config.hidden_size, config.intermediate_size
    heads, kv_heads, head = attention_heads(config)

    def best(kind: str, n: int) -> float:
        return max(rates.elementwise(kind, tool, batch * seq, n, dtype) for tool in ("torch", "ptq"))

    rotary = max(rates.rotary(tool, batch, heads, seq, head, dtype) for tool in ("torch", "ptq"))
    return (2 * h / best("norm", h) + 2 * h / best("add", h) + i / best("silu_mul", i)
            + (heads + kv_heads) * head / rotary) / 1e9


def solved_weights(config) -> list[tuple[int, int]]:
    """[out, in] of each weight GPTQ solves in a block: q/k/v stacked, o, gate/up stacked, down."""
    h, i = config.hidden_size, config.intermediate_size
    heads, kv_heads, head = attention_heads(config)
    q, kv = heads * head, kv_heads * head
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def attention_heads(config) -> tuple[int, int, int]:
    """Query heads, key-value heads and the head dimension of a transformers config."""
    heads = config.num_attention_heads
    return heads, config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


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
