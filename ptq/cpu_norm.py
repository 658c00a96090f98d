"""The calibration passes' RMSNorms on a CPU: compiled (ptq/cpu_norm.c) in place of
transformers' LlamaRMSNorm.forward, which stays the reference (tests compare the two bit for
bit).

transformers' norm makes seven passes over a batch's activations (a float32 copy, its
square, the sum, the products, their rounding to bf16, the product with the weight and its
rounding); the compiled one reads a row twice, to sum its squares and to write its
outputs, in the same float32 steps, and sums in the order of the ATen kernel that sums
here: the same bits as torch's. Which order that is (vectors of 16 floats or of 8: torch
2.13 sums with its AVX2 kernel on an AVX-512 CPU too) lanes() finds once, on a probe. The
calibration passes compute two norms per block and batch (each once: Memo in
ptq.calibration.memo). On a 2-core AMD EPYC (Zen 5), 2048 tokens on one thread:
SmolLM2's 576 features 0.36 against 0.55-0.59 ms, 1536 0.78 against 2.4 ms; the
SmolLM2-shaped GPTQ job (W4 g64, 32 x 256 tokens) 6.90 against 7.23 s, medians of nine
runs alternating with torch's norm, the same checkpoint.

Only where that holds: a module whose forward is transformers' Llama RMSNorm's code (Qwen2,
Qwen3, Mistral and others copy it; Gemma's, with 1 + weight, is other code), bf16 input
and weight on a CPU, unit stride along MIN_FEATURES to MAX_FEATURES features, no hooks,
no autograd. Anything else runs the module's own forward.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from ptq.algorithms import compiled
from ptq.glue import code_of, hooked, instance_forwards, llama_code

MIN_FEATURES = 64  # fewer: ATen may sum a row in scalar loops, another order
MAX_FEATURES = 32768  # from ATen's grain size on, a single row's sum is split across threads
PROBE_FEATURES = (100, 576, 4160)  # a tail of 4 values; 576; long enough for the sum's cascade
PROBE_ROWS = 64


def lanes() -> int | None:
    """The vector width (16 or 8 floats) in whose order ATen sums a row here: the one whose
    sums of squares are torch's on a probe of random bf16 rows; None where neither is (or
    the library is not built): then the compiled norm does not run. Found once per library
    loaded (a call while none is, as in a test that takes it away, is not remembered)."""
    lib = compiled.library()[0]
    return None if lib is None else _lanes_of(lib)


@functools.cache
def _lanes_of(lib) -> int | None:
    g = torch.Generator().manual_seed(0)
    probes = [(torch.randn(PROBE_ROWS, n, generator=g) * 4).to(torch.bfloat16) for n in PROBE_FEATURES]

    def same_sums(width: int) -> bool:
        for x in probes:
            sums = torch.empty(x.shape[0], dtype=torch.float32)
            lib.ptq_sum_squares_bf16(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], width, sums.data_ptr())
            if not torch.equal(sums, x.float().pow(2).sum(-1)):
                return False
        return True

    matching = [width for width in (16, 8) if same_sums(width)]
    return matching[0] if len(matching) == 1 else None


def compiled_forward(module: nn.Module) -> Callable[[Tensor], Tensor | None] | None:
    """x -> module(x) by the compiled norm, or None for an x it does not apply to; None
    when module is not a Llama-style RMSNorm or the compiled norm does not run here."""
    reference = llama_code("LlamaRMSNorm")
    if reference is None or code_of(type(module).forward) != reference:
        return None
    if not isinstance(getattr(module, "weight", None), Tensor) or not isinstance(
            getattr(module, "variance_epsilon", None), float):
        return None
    return functools.partial(_forward, module) if lanes() is not None else None


def _forward(module: nn.Module, x: Tensor) -> Tensor | None:
    weight = module.weight
    applies = (
        x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16
        and weight.dim() == 1 and x.dim() >= 1 and x.shape[-1] == weight.shape[0]
        and MIN_FEATURES <= x.shape[-1] < MAX_FEATURES and x.stride(-1) == 1 and not hooked(module)
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )
    return rms_norm(x, weight, module.variance_epsilon) if applies else None


@contextlib.contextmanager
def compiled_norms(block: nn.Module) -> Iterator[int]:
    """The block's Llama-style RMSNorms (compiled_forward) compute compiled while inside,
    where the compiled norm applies to the call (else their class's forward): the norm set
    as the instance's forward, none where the instance has one of its own (accelerate's
    offloading sets one); yields how many. For passes that call the block as it is (AWQ's
    and SmoothQuant's statistics); the true-sequential engine's own stand-ins
    (ptq.calibration.memo.Memo) call compiled_forward themselves."""
    found = [(m, f) for m in block.modules() if "forward" not in vars(m) and (f := compiled_forward(m)) is not None]
    with instance_forwards([(m, functools.partial(_compiled_or_own, m, f)) for m, f in found]):
        yield len(found)


def _compiled_or_own(module: nn.Module, forward: Callable[[Tensor], Tensor | None], x: Tensor, *args, **kwargs):
    output = None if args or kwargs else forward(x)
    return type(module).forward(module, x, *args, **kwargs) if output is None else output


def rms_norm(x: Tensor, weight: Tensor, eps: float, portable: bool = False) -> Tensor:
    """weight · bf16(x · 1/√(mean(x²) + eps)) over the last dimension of x [..., n], as
    LlamaRMSNorm.forward computes it (bf16 x and weight [n] on a CPU, unit stride along n;
    lanes() must have found the order). portable: not the AVX-512 code (the same bits:
    for tests)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view where the rows have one stride
    out = torch.empty(rows.shape, dtype=torch.bfloat16)
    weight = weight.contiguous()
    status = compiled.library()[0].ptq_rms_norm_bf16(
        rows.data_ptr(), rows.stride(0), weight.data_ptr(), 0, rows.shape[0], n, ctypes.c_float(eps), lanes(),
        int(portable), out.data_ptr(), n)
    assert status == 0, f"the compiled norm does not sum in vectors of {lanes()} floats"
    return out.view(x.shape)
