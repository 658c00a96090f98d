"""Per scheme: bytes, concurrency, decode and prefill bounds on an accelerator; the recommendation.

The bounds are floors, what the hardware allows at its peak figures: a decoding step reads
every weight it uses once (the embedding table only a row per request unless lm_head is tied
to it) and every cached token of every request, so TPOT >= bytes / bandwidth; it also does
2 FLOPs per weight per request and the attention, so TPOT >= FLOPs / matmul rate. Prefill
is the same sum over the prompt's tokens, almost always compute-bound: TTFT >= FLOPs / rate.
Weight-only schemes (W4A16, W3A16) still compute in bf16; W8A8 int8 and FP8 at the 8-bit rate.
Tensor parallelism over N GPUs divides weights, KV cache (by kv heads), bytes and FLOPs by N
(no communication counted). Real engines reach perhaps 50-80% of these bounds.

Memory per GPU: `utilization` of it is the engine's (vLLM's gpu_memory_utilization,
default 0.90; the rest: CUDA context, other processes), minus `workspace_gb` for
activations and CUDA graphs, minus the weights' share; the KV cache gets what is left.

Recommendation (the order practitioners follow): the least aggressive scheme that meets the
constraint (fits, the concurrency, the TPOT target) and has a kernel on the GPU, in the order
BF16, FP8 (weights, activations and KV cache), W8A8 int8, W4A16, W4A16 + fp8 KV, W4A16 +
int4 KV, W3A16: FP8 before 4 bits unless memory demands them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ptq.errors import PtqError
from ptq.kv.scheme import KVCacheScheme
from ptq.plan import arithmetic
from ptq.plan.accelerators import Accelerator
from ptq.plan.model import ModelFacts
from ptq.schemes import PRESETS, Scheme

GB = 1e9


@dataclass(frozen=True)
class Workload:
    context: int = 8192  # tokens each request may hold (prompt + output): its KV reservation
    prompt_tokens: int = 7680
    output_tokens: int = 512
    concurrency: int | None = None  # requests served at once (a constraint)
    target_tpot_ms: float | None = None  # time per output token wanted (a constraint)
    gpus: int = 1
    utilization: float = 0.90
    workspace_gb: float = 1.0  # per GPU


def workload(context: int | None = None, prompt_tokens: int | None = None, output_tokens: int | None = None,
             **rest) -> Workload:
    """A Workload from what was given: context defaults to prompt + output (or 8192), prompt to
    context - output, output to 512 (at most half the context)."""
    if context is None:
        context = (prompt_tokens or 7680) + (output_tokens or 512) if prompt_tokens else 8192
    output_tokens = output_tokens if output_tokens is not None else min(512, context // 2)
    prompt_tokens = prompt_tokens if prompt_tokens is not None else context - output_tokens
    for what, value in (("--context", context), ("--prompt-tokens", prompt_tokens), ("--output-tokens", output_tokens)):
        if value < 1:
            raise PtqError(f"{what} is {value}; give at least 1 token")
    if prompt_tokens + output_tokens > context:
        raise PtqError(f"--prompt-tokens {prompt_tokens} + --output-tokens {output_tokens} exceed --context {context}; "
                       "raise --context or shorten the request")
    work = Workload(context, prompt_tokens, output_tokens, **rest)
    if work.concurrency is not None and work.concurrency < 1:
        raise PtqError(f"--concurrency is {work.concurrency}; give at least 1 request")
    if work.target_tpot_ms is not None and not work.target_tpot_ms > 0:
        raise PtqError(f"--target-tpot-ms is {work.target_tpot_ms}; give a positive number of milliseconds")
    if work.gpus < 1:
        raise PtqError(f"--gpus is {work.gpus}; give at least 1")
    if not 0 < work.utilization <= 1:
        raise PtqError(f"--gpu-memory-utilization is {work.utilization}; give a fraction in (0, 1]")
    if work.workspace_gb < 0:
        raise PtqError(f"--workspace-gb is {work.workspace_gb}; give 0 or more")
    return work


@dataclass(frozen=True)
class Candidate:
    """A way to serve the model: weights (None: 16-bit) and KV cache (None: 16-bit)."""

    name: str
    scheme: Scheme | None = None
    kv: KVCacheScheme | None = None
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    g_idx: bool = False  # GPTQ activation order "group" stores weight_g_idx
    stored: bool = False  # the checkpoint as it is (bytes from its files)


KIVI4 = KVCacheScheme(scheme="INT4", strategy="kivi")
FP8_KV = KVCacheScheme(scheme="FP8", strategy="tensor")
STANDARD = (  # in the order of the recommendation: least aggressive first
    Candidate("BF16"),
    Candidate("FP8+KV-FP8", PRESETS["FP8_DYNAMIC"], FP8_KV),  # as vLLM serves fp8: --kv-cache-dtype fp8
    Candidate("W8A8-INT8", PRESETS["W8A8"]),
    Candidate("W4A16", PRESETS["W4A16"]),
    Candidate("W4A16+KV-FP8", PRESETS["W4A16"], FP8_KV),
    Candidate("W4A16+KV-INT4", PRESETS["W4A16"], KIVI4),
    Candidate("W3A16", PRESETS["W3A16"]),
)


def candidate_from_recipe(name: str, recipe) -> Candidate:
    """The Candidate a ptq Recipe (or llm-compressor recipe, translated) serves with."""
    step = recipe.weight_step
    if step is None:
        return Candidate(name, None, recipe.kv_cache)
    g_idx = getattr(step, "actorder", None) == "group" and step.scheme.weights.strategy == "group"
    return Candidate(name, step.scheme, recipe.kv_cache, tuple(step.targets), tuple(step.ignore), g_idx)


@dataclass
class Estimate:
    candidate: Candidate
    weight_bytes: int  # all GPUs together
    quantized_linears: int  # Linears in the scheme
    linear_bits: float  # bits per weight of the Linears the scheme quantizes, scales included
    kv_bytes_per_token: float  # at the context (kivi: its 16-bit window included)
    kv_bytes_per_request: int  # at the context
    usable_bytes: float  # per GPU, for the KV cache
    max_concurrency: int  # requests at the full context that fit
    batch: int  # requests decoding together in the bounds below
    decode_bytes: float  # per step, all GPUs
    decode_flops: float
    tpot_memory_s: float
    tpot_compute_s: float
    tpot_one_s: float  # one request alone
    prefill_flops: float
    ttft_s: float
    ttft_memory_s: float
    binds: str
    kernel: bool
    kernel_note: str
    meets: bool = False
    why_not: str = ""
    arithmetic: dict = field(default_factory=dict)  # --explain's lines

    @property
    def tpot_s(self) -> float:
        return max(self.tpot_memory_s, self.tpot_compute_s)

    @property
    def tokens_per_s_user(self) -> float:
        return 1 / self.tpot_s

    @property
    def tokens_per_s_total(self) -> float:
        return self.batch / self.tpot_s


def weight_bytes(facts: ModelFacts, candidate: Candidate) -> tuple[int, int, int, int, int]:
    """(total bytes, bytes of the embedding table, quantized Linears, their bytes, their
    weights' count) as ptq stores them."""
    from ptq.targets import matches

    model = facts.skeleton
    quantized, linear_bytes, total, weights = 0, 0, 0, 0
    done = set()
    if candidate.scheme is not None:
        for name, lin in facts.linears.items():
            module = model.get_submodule(name)
            if not matches(name, module, candidate.targets) or matches(name, module, candidate.ignore):
                continue
            if facts.tied and name == "lm_head":
                continue  # the embedding table it shares stays 16-bit
            nbytes = arithmetic.linear_bytes(lin.out_features, lin.in_features, candidate.scheme,
                                             dtype_bytes=facts.dtype_bytes, bias=lin.bias, g_idx=candidate.g_idx)
            quantized += 1
            linear_bytes += nbytes
            weights += lin.out_features * lin.in_features
            done.update({f"{name}.weight", f"{name}.bias"})
    total = linear_bytes + sum(n * facts.dtype_bytes for name, n in facts.tensors.items() if name not in done)
    total += arithmetic.kv_scale_bytes(facts.attention, candidate.kv, facts.dtype_bytes)
    return total, facts.tensors[facts.embedding] * facts.dtype_bytes, quantized, linear_bytes, weights


def checkpoint_candidate(facts: ModelFacts) -> Candidate | None:
    """The checkpoint as stored, when MODEL is a quantized checkpoint (its first config group's scheme)."""
    qconfig = facts.quantization_config
    if qconfig is None and facts.kv_cache is None:
        return None
    scheme = None
    if qconfig is not None and qconfig.get("quant_method") == "compressed-tensors" and qconfig.get("config_groups"):
        from ptq.checkpoint.reader import group_schemes

        scheme = group_schemes(qconfig)[0].scheme
    elif qconfig is not None and qconfig.get("quant_method") in ("gptq", "awq"):
        scheme = PRESETS["W4A16"] if qconfig.get("bits") == 4 else None  # weight-only: bf16 matmuls
    return Candidate("checkpoint", scheme, facts.kv_cache, stored=True)


def estimate(facts: ModelFacts, acc: Accelerator, work: Workload, candidate: Candidate) -> Estimate:
    n, att = work.gpus, facts.attention
    total, embed, quantized, qbytes, qlinear_weights = weight_bytes(facts, candidate)
    if candidate.stored and facts.stored_bytes is not None:
        total = facts.stored_bytes  # what the files hold, exactly
    bits = 8 * qbytes / qlinear_weights if qlinear_weights else 8.0 * facts.dtype_bytes
    kv_request = arithmetic.kv_bytes(att, work.context, candidate.kv, dtype_bytes=facts.dtype_bytes)
    kv_share = max(1, math.ceil(att.kv_heads / n)) / att.kv_heads  # of each request's cache, per GPU
    usable = work.utilization * acc.memory_gb * GB - work.workspace_gb * GB - total / n
    max_conc = max(0, math.floor(usable / (kv_request * kv_share)))
    read = total - (0 if facts.tied else embed)  # a decoding step reads one embedding row per request
    active = _active_linear_weights(facts)

    def step(batch: int) -> tuple[float, float, float, float]:
        """(bytes, FLOPs, memory time, compute time) of one decoding step of `batch` requests at the context."""
        nbytes = read + batch * kv_request
        linear = 2 * active * batch
        attention = batch * arithmetic.decode_attention_flops(att, work.context)
        compute = linear / (n * _rate(acc, candidate)) + attention / (n * acc.rate("bf16"))
        return nbytes, linear + attention, nbytes / (n * acc.bandwidth_gbs * GB), compute

    batch = _batch(work, max_conc, step)
    nbytes, flops, t_mem, t_compute = step(max(batch, 1))
    one = max(step(1)[2:])
    p = work.prompt_tokens
    linear = 2 * active * p
    attention = arithmetic.prefill_attention_flops(att, p)
    ttft_compute = linear / (n * _rate(acc, candidate)) + attention / (n * acc.rate("bf16"))
    ttft_memory = (read + kv_request * p / work.context) / (n * acc.bandwidth_gbs * GB)
    kernel, note = kernel_for(acc, candidate)
    est = Estimate(candidate, total, quantized, bits, kv_request / work.context, kv_request, usable, max_conc,
                   batch, nbytes, flops, t_mem, t_compute, one, linear + attention, max(ttft_compute, ttft_memory),
                   ttft_memory, _binds(work, max_conc, t_mem, t_compute), kernel, note)
    est.arithmetic = _explain(facts, acc, work, est, read, kv_share)
    return est


def _rate(acc: Accelerator, candidate: Candidate) -> float:
    """The matmul rate of the candidate's Linears; bf16 where the GPU lacks its 8-bit kind (no kernel anyway)."""
    return acc.rate(arithmetic.matmul_kind(candidate.scheme)) or acc.rate("bf16")


def _active_linear_weights(facts: ModelFacts) -> float:
    """Weights one token multiplies: every Linear's, the experts' scaled by the share a token uses."""
    total = 0.0
    for name, lin in facts.linears.items():
        share = facts.experts_fraction if ".experts." in name else 1.0
        total += lin.out_features * lin.in_features * share
    return total


def _batch(work: Workload, max_conc: int, step) -> int:
    """Requests decoding together: the concurrency asked for; else the most that meet the TPOT
    target; else as many as fit."""
    if work.concurrency is not None:
        return work.concurrency
    if work.target_tpot_ms is None or max_conc < 1:
        return max_conc
    target = work.target_tpot_ms / 1e3
    low, high = 0, max_conc  # the largest batch whose TPOT floor meets the target (monotone in batch)
    while low < high:
        mid = (low + high + 1) // 2
        _, _, t_mem, t_compute = step(mid)
        low, high = (mid, high) if max(t_mem, t_compute) <= target else (low, mid - 1)
    return low


def _binds(work: Workload, max_conc: int, t_mem: float, t_compute: float) -> str:
    if max_conc < 1:
        return "memory (does not fit)"
    if work.concurrency is not None and work.concurrency > max_conc:
        return "memory"
    return "bandwidth" if t_mem >= t_compute else "compute"


def kernel_for(acc: Accelerator, candidate: Candidate) -> tuple[bool, str]:
    """Whether the GPU runs the candidate's matmuls and cache, and where the kernel is."""
    kind = arithmetic.matmul_kind(candidate.scheme)
    if kind == "fp8" and not acc.fp8:
        return False, f"no fp8 tensor cores on {acc.name}"
    kv = candidate.kv
    if kv is not None and kv.scheme == "FP8" and not acc.fp8:
        return False, f"no fp8 on {acc.name} for the fp8 KV cache"
    if kv is not None and kv.scheme != "FP8":
        return True, f"{kv.scheme} KV: ptq's cache and Triton decode kernel (not vLLM)"
    if candidate.scheme is not None and candidate.scheme.format == "pack-quantized" \
            and candidate.scheme.weights.num_bits not in (4, 8):
        return True, f"{candidate.scheme.weights.num_bits}-bit weights: ptq's Triton kernel (vLLM runs 4 and 8 bits)"
    return True, ""


def evaluate_candidates(facts: ModelFacts, acc: Accelerator, work: Workload,
                        extra: list[Candidate] = ()) -> list[Estimate]:
    """Estimates for the standard candidates, the checkpoint itself (if MODEL is one) and `extra`."""
    candidates = list(STANDARD)
    stored = checkpoint_candidate(facts)
    if stored is not None:
        candidates.append(stored)
    candidates += list(extra)
    estimates = [estimate(facts, acc, work, c) for c in candidates]
    for est in estimates:
        est.meets, est.why_not = _meets(est, work)
    return estimates


def _meets(est: Estimate, work: Workload) -> tuple[bool, str]:
    need = work.concurrency or 1
    if not est.kernel:
        return False, est.kernel_note
    if est.max_concurrency < need:
        if est.max_concurrency < 1:
            return False, "does not fit one request at the context"
        return False, f"holds {est.max_concurrency} requests at the context, not {need}"
    if work.target_tpot_ms is not None:
        tpot = est.tpot_s if work.concurrency is not None else est.tpot_one_s
        if tpot * 1e3 > work.target_tpot_ms:
            return False, f"TPOT floor {tpot * 1e3:.1f} ms > {work.target_tpot_ms:g} ms"
    return True, ""


def recommend(estimates: list[Estimate], work: Workload) -> tuple[Estimate | None, list[str]]:
    """The first estimate, in the standard order then the others, that meets the constraint; and why."""
    constraint = _constraint(work)
    chosen = next((e for e in estimates if e.meets and not e.candidate.stored), None)
    if chosen is None:
        chosen = next((e for e in estimates if e.meets), None)
    if chosen is None:
        best = max(estimates, key=lambda e: e.max_concurrency)
        return None, [f"no scheme meets {constraint}: {best.candidate.name} comes closest ({best.why_not}); "
                      "add GPUs (--gpus), shorten --context or relax the target"]
    skipped = [e for e in estimates[:estimates.index(chosen)]]
    why = []
    if skipped:
        why.append("; ".join(f"{e.candidate.name}: {e.why_not}" for e in skipped) + ".")
    reason = (f"{chosen.candidate.name} is the least aggressive scheme that meets {constraint}: "
              f"{chosen.max_concurrency} requests fit, TPOT floor {chosen.tpot_s * 1e3:.1f} ms at {chosen.batch}")
    if chosen.candidate.name == "BF16":
        reason += ("; nothing needs quantizing: FP8 would still cut memory and cost in half (no fp8 here: "
                   "W8A8 int8)" if not _has_fp8(estimates) else "; nothing needs quantizing: FP8 would still "
                   "halve the weights and raise concurrency")
    why.append(reason + ".")
    if work.concurrency is None and work.target_tpot_ms is None:
        why.append("Give --concurrency or --target-tpot-ms for a constraint of your own.")
    return chosen, why


def _has_fp8(estimates: list[Estimate]) -> bool:
    return any(e.candidate.name.startswith("FP8") and e.kernel for e in estimates)


def _constraint(work: Workload) -> str:
    parts = [f"{work.concurrency or 1} request(s) at {work.context:,} tokens"]
    if work.target_tpot_ms is not None:
        parts.append(f"TPOT <= {work.target_tpot_ms:g} ms")
    return " and ".join(parts)


def _explain(facts: ModelFacts, acc: Accelerator, work: Workload, est: Estimate, read: float,
             kv_share: float) -> dict:
    """The arithmetic behind the estimate, as (label -> formula = value) lines."""
    att, n = facts.attention, work.gpus
    kv = est.candidate.kv
    kv_formula = ("2 (K,V) x {l} layers x {h} kv heads x {d} head_dim x 2 bytes" if kv is None else
                  "2 x {l} x {h} x {d} x 1 byte" if kv.static else
                  "kivi {b}-bit: codes + fp16 scale/min per group of {g} + {r}-token 16-bit window, at {c} tokens")
    kv_formula = kv_formula.format(l=att.layers, h=att.kv_heads, d=att.head_dim, b=kv.bits if kv else 16,
                                   g=getattr(kv, "group_size", 0), r=getattr(kv, "residual", 0), c=work.context)
    usable = (f"{work.utilization:.2f} x {acc.memory_gb:g} GB - {work.workspace_gb:g} GB workspace - "
              f"{est.weight_bytes / GB:.3f} GB / {n} GPU(s)")
    return {
        "weights": f"{est.weight_bytes:,} bytes ({est.quantized_linears} Linears at {est.linear_bits:.3f} bits incl. "
                   f"scales; the rest in 16 bits)",
        "KV per token": f"{kv_formula} = {est.kv_bytes_per_token:,.1f} bytes",
        "KV per request": f"{est.kv_bytes_per_token:,.1f} x {work.context:,} tokens = {est.kv_bytes_per_request:,} bytes"
                          + (f" ({kv_share:.3f} of it per GPU)" if n > 1 else ""),
        "usable per GPU": f"{usable} = {est.usable_bytes / GB:.3f} GB",
        "max concurrency": f"floor({est.usable_bytes / GB:.3f} GB / {est.kv_bytes_per_request * kv_share / GB:.4f} GB)"
                           f" = {est.max_concurrency}",
        "decode step": f"({read:,.0f} weight bytes read + {est.batch} x {est.kv_bytes_per_request:,} KV bytes) / "
                       f"({n} x {acc.bandwidth_gbs:g} GB/s) = {est.tpot_memory_s * 1e3:.2f} ms; "
                       f"{est.decode_flops:.3e} FLOPs / rate = {est.tpot_compute_s * 1e3:.2f} ms",
        "prefill": f"{est.prefill_flops:.3e} FLOPs for {work.prompt_tokens:,} tokens / ({n} x "
                   f"{(_rate(acc, est.candidate)) / 1e12:g} T{arithmetic.matmul_kind(est.candidate.scheme)} ops/s; "
                   f"attention at bf16) = {est.ttft_s * 1e3:.1f} ms",
    }
