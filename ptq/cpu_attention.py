"""The calibration passes' causal attention on a CPU: compiled (ptq/cpu_attention.c) in place
of torch's scaled_dot_product_attention, which transformers' "sdpa" implementation calls and
which stays the reference (tests compare the two). bf16 passes take it on a CPU with
AVX512-BF16 (with AMX, its products on the tiles), float32 ones (a float32 model, or any on
a CPU without fast bf16) on one with AVX2 and FMA.

torch's CPU kernel runs at 60-70 GFLOP/s on one core of a 2-core EPYC (Zen 5) for
SmolLM2's heads (256 positions, 64 dimensions), a fifth of the bf16 GEMM rate: 3.2
thread-seconds of the SmolLM2-shaped GPTQ job, 0.9 of the bundled model's 2. The compiled
kernel does the same arithmetic (bf16 products summed in float32, a float32 softmax, its
weights rounded to bf16 for the product with V) 4-6 times as fast, with the same error
against float64 (94-99% of its outputs the very bf16 torch's gives): quantize 9.3-10.5 ->
8.5-8.9 s on the SmolLM2-shaped model, 1.04 -> 0.76 s on the bundled one.

In float32, torch's kernel runs at 28-33 GFLOP/s (causal FLOPs) on one core of a 2-core
AVX2 EPYC (Zen 3), against 70-85 for its float32 GEMMs; the compiled one (float32
throughout: scores, softmax, weights and sums) at about twice that.

Only where it computes what sdpa would: bf16 or float32 tensors on a CPU, no attention mask
(the causal mask transformers leaves to is_causal), no dropout, no position bias, no softcap
or sinks, as many queries as keys, a head dimension that is a multiple of 32 (bf16) or 16
(float32). Any other call
goes to transformers' sdpa function and is counted; the report's notes name how many and
the first reason, and `calibration_attention` in ptq.json says whether it applied.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ptq.algorithms import compiled
from ptq.devices import cpu_budget, cpu_parallel

NAME = "ptq_cpu_causal"  # the attention implementation's name in transformers' registry
# arguments that change what attention computes (transformers' kwargs for some models)
_CHANGES_THE_MATH = frozenset({"softcap", "s_aux", "sinks", "position_bias", "head_mask", "cu_seq_lens_q",
                               "cu_seq_lens_k"})
_POSITIONS = frozenset({"position_ids", "cache_position"})  # tensors that do not (rotary already applied)


HEAD_MULTIPLE = {torch.bfloat16: 32, torch.float32: 16}  # the kernels' head dimensions: multiples of these


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the compiled kernel for tensors of this dtype runs here: the library is
    built and the CPU has AVX512-BF16 (AMX CPUs have it too) for bf16, AVX2 and FMA for
    float32. Where it runs the calibration passes take it: it was measured faster than
    torch's everywhere. On a CPU with AMX the bf16 kernel multiplies on the tiles, as torch's
    own flash-attention kernel does (its brgemm); before it did (when the VDPBF16PS code was
    all it had), torch's kernel was the faster there and kept. One thread of a 2-core Xeon
    with AMX, ms per sample, compiled on the tiles / torch's (scripts/bench_cpu_attention.py)
    / compiled with VDPBF16PS: 0.38-0.41 / 0.52-0.57 / 1.01 (9 heads of 64, 256 positions),
    0.96-0.98 / 1.51-1.56 / 1.79 (8 of 32, 512), 79 / 101 / 369 (32 of 128, 2048). GPTQ on
    the bundled model 0.56-0.61 -> 0.55-0.60 s, the random benchmark model 3.83 -> 3.75 s,
    the SmolLM2-shaped one within its noise."""
    if dtype == torch.bfloat16:
        return compiled.avx512_bf16()
    return dtype == torch.float32 and compiled.attention_f32()


def causal_attention(query: Tensor, key: Tensor, value: Tensor, scale: float, tiles: bool | None = None) -> Tensor:
    """softmax(q kᵀ · scale, causal) v for query [B, H, S, D] and key, value [B, KV, S, D]
    (bf16 or float32, CPU, unit stride along D; H a multiple of KV, D of HEAD_MULTIPLE):
    [B, S, H, D] in their dtype, the layout transformers' attention functions return.
    Samples are split across torch's threads (the same bits on any count). tiles: bf16 on
    AMX tiles (by default where the CPU has them) or with VDPBF16PS; their last bits differ."""
    B, H, S, D = query.shape
    KV, dtype = key.shape[1], query.dtype
    assert available(dtype) and dtype == key.dtype == value.dtype
    assert key.shape == value.shape == (B, KV, S, D) and H % KV == 0 and D % HEAD_MULTIPLE[dtype] == 0
    assert query.stride(3) == key.stride(3) == value.stride(3) == 1
    out = torch.empty(B, S, H, D, dtype=dtype)
    strides = torch.tensor([*query.stride()[:3], *key.stride()[:3], *value.stride()[:3],
                            out.stride(0), out.stride(2), out.stride(1)], dtype=torch.int64)
    lib = compiled.library()[0]
    if dtype == torch.bfloat16:
        tiles = compiled.amx() if tiles is None else tiles
        assert not tiles or compiled.amx(), "AMX tiles asked for on a CPU without them"
        kernel = lib.ptq_attention_causal_amx if tiles else lib.ptq_attention_causal
    else:
        kernel = lib.ptq_attention_causal_f32
    threads = min(cpu_budget(), B)

    def samples(b0: int, b1: int) -> None:
        code = kernel(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(),
                      b0, b1, H, KV, S, D, strides.data_ptr(), ctypes.c_float(scale))
        if code != 0:
            raise MemoryError(f"ptq's compiled attention could not allocate its buffers for {S} positions")

    cuts = [B * t // threads for t in range(threads + 1)]
    cpu_parallel([functools.partial(samples, a, b) for a, b in zip(cuts, cuts[1:]) if b > a], threads)
    return out


class Counts:
    """Calls of the compiled attention and those handed to sdpa, for the report."""

    def __init__(self) -> None:
        self.calls = self.fallbacks = 0
        self.why: str | None = None  # the first fallback's reason
        self._lock = threading.Lock()  # batches run side by side

    def count(self, why: str | None) -> None:
        with self._lock:
            if why is None:
                self.calls += 1
            else:
                self.fallbacks += 1
                self.why = self.why or why

    def note(self) -> str | None:
        """A line for the report when some calls ran torch's kernel, else None."""
        if not self.fallbacks:
            return None
        return (f"attention: {self.fallbacks} of {self.calls + self.fallbacks} calls in the calibration passes ran "
                f"torch's sdpa kernel, not ptq's compiled one ({self.why})")


COUNTS = Counts()  # of the compiled_attention block running now (calibration runs one at a time)


def _why_not(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float,
             is_causal, kwargs: dict) -> str | None:
    """Why the compiled kernel would not compute what sdpa does for this call, or None."""
    if query.device.type != "cpu" or not query.dtype == key.dtype == value.dtype or not available(query.dtype):
        return f"{query.dtype} on {query.device.type}"
    if attention_mask is not None:
        return "an attention mask (padding)"
    if dropout:
        return "dropout"
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if not causal:
        return "not causal"
    if query.shape[2] != key.shape[2] or query.shape[2] < 2:
        return "queries and keys of different lengths"
    multiple = HEAD_MULTIPLE[query.dtype]
    if query.shape[-1] % multiple or query.shape[1] % key.shape[1] or key.shape != value.shape:
        return f"head dimension {query.shape[-1]} (a multiple of {multiple} runs compiled)"
    extra = {k for k, v in kwargs.items() if v is not None and (
        k in _CHANGES_THE_MATH or (isinstance(v, Tensor) and k not in _POSITIONS))}
    if kwargs.get("output_attentions"):
        extra.add("output_attentions")
    if extra:
        return f"arguments {sorted(extra)}"
    if min(t.stride(3) for t in (query, key, value)) != 1:
        return "strided head dimension"
    return None


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function signature: the compiled kernel where it computes
    what sdpa would, transformers' sdpa function elsewhere."""
    why = _why_not(module, query, key, value, attention_mask, dropout, is_causal, kwargs)
    if why is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        COUNTS.count(why)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    COUNTS.count(None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return causal_attention(query, key, value, scale), None


@functools.cache
def _registered() -> bool:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # masks as for sdpa, should one be made inside
    return True


def _swapped_configs(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> list:
    """The configs compiled_attention swaps: those of the model's modules that choose
    transformers' "sdpa" attention, where the passes run on a CPU in a dtype whose kernel
    is here (available; the activations' dtype); none elsewhere."""
    if torch.device(device).type != "cpu" or not available(dtype):
        return []
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_attn_implementation", None) == "sdpa"}
    return list(configs.values())


def applies(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether compiled_attention(model, device, dtype) runs the compiled kernel (where
    calls allow)."""
    return bool(_swapped_configs(model, device, dtype))


@contextlib.contextmanager
def compiled_attention(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> Iterator[Counts | None]:
    """Inside the block, the model's "sdpa" attention runs as attention_forward (on every
    config that names it); yields the block's Counts, or None where nothing changes
    (no kernel here for the dtype, passes on a GPU, another attention)."""
    global COUNTS
    configs = _swapped_configs(model, device, dtype)
    if not configs:
        yield None
        return
    _registered()
    COUNTS = counts = Counts()
    for config in configs:
        config._attn_implementation = NAME
    try:
        yield counts
    finally:
        for config in configs:
            config._attn_implementation = "sdpa"
