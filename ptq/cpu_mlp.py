"""The calibration passes' SiLU-gated MLP products on a CPU: compiled (ptq/cpu_mlp.c) in
place of the act_fn(gate) * up of transformers' LlamaMLP.forward, which stays the reference
(tests compare the two bit for bit).

torch computes the product in two passes over the activations (F.silu, its result rounded
to bf16, then the product rounded again), each widening bf16 to float32 and back, and its
SiLU evaluates exp for every element. The compiled one looks the SiLU of each bf16 value up
in a table of all 65536 that torch's F.silu computed once (silu_table: its vector code, on
one thread, so torch's bits), multiplies in float32 and rounds once, in one pass. A
product that is not finite sends the whole call back to torch (its vector code writes NaN
as 0xFFFF, its scalar code as 0x7FC0). SmolLM2's 2048 x 1536 products on one thread of a
Xeon (AMX) VM: 1.57 against 3.80 ms.

Only where that holds: a module whose forward is transformers' LlamaMLP's code (Mistral,
Qwen2, Qwen3 and others copy it), whose act_fn is a SiLU (torch's nn.SiLU or transformers'
SiLUActivation), no hooks on its act_fn and no forward of its own set on the instance
(accelerate's offloading sets one), bf16 gate and up outputs of the same shape on a CPU,
each a stack of unit-stride rows at one row stride (contiguous, or column slices of one
wider output: ptq.calibration.sequential computes gate and up in one GEMM). Anything else
runs the module's own forward. torch's SiLU takes its scalar code for what its vectors
leave over (and for strided tensors): that code gives the vector code's bits for every
finite bf16 input (all 65536 patterns checked, torch 2.13), and a non-finite one makes a
non-finite product, which goes back to torch.
The Linears are called as the original calls them, gate_proj before up_proj, so the passes'
hooks, replays and stops see the same calls.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ptq.algorithms import compiled
from ptq.devices import cpu_threads
from ptq.glue import hooked, instance_forwards, runs_llama_code


def _silu_types() -> tuple[type, ...]:
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return (nn.SiLU,)
    return (nn.SiLU, SiLUActivation)


@functools.cache
def silu_table() -> Tensor:
    """F.silu of every bf16 bit pattern in order, as int16 bits, and one entry more (the
    compiled lookup reads 32 bits at an entry's place): [65537], computed by torch's vector
    code on one thread (65536 values are whole vectors and one chunk)."""
    patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    with cpu_threads(1):
        values = torch.nn.functional.silu(patterns)
    return torch.cat([values.view(torch.int16), torch.zeros(1, dtype=torch.int16)])


def applies_to(module: nn.Module) -> bool:
    """Whether module is a Llama-style MLP with a SiLU whose product the compiled code may
    compute here (the library is built)."""
    if not runs_llama_code(module, "LlamaMLP"):
        return False
    if not all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj")):
        return False
    return type(getattr(module, "act_fn", None)) in _silu_types() and compiled.unavailable() is None


def _rows(t: Tensor) -> int | None:
    """The stride between t's rows of its last dimension where t is a stack of such rows at
    one stride, each of unit stride (contiguous, or a column slice of a wider tensor: gate's
    and up's outputs of one stacked GEMM); else None."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    n, stride = t.shape[-1], t.stride(-2) if t.dim() > 1 else t.shape[-1]
    expected = stride
    for size, actual in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size > 1 and actual != expected:
            return None
        expected *= size
    return stride if stride >= n else None


def silu_mul(gate: Tensor, up: Tensor, portable: bool = False) -> Tensor | None:
    """bf16(silu(gate) · up) as torch computes F.silu(gate) * up, contiguous, or None where
    the compiled code does not apply to these tensors (see the module's docstring) or a
    product is not finite. portable: not the AVX-512 code (the same bits: for tests)."""
    applies = (
        gate.device.type == up.device.type == "cpu" and gate.dtype == up.dtype == torch.bfloat16
        and gate.shape == up.shape and gate.numel() > 0
        and not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad))
    )
    strides = (_rows(gate), _rows(up)) if applies else (None, None)
    if None in strides:
        return None
    out = torch.empty(gate.shape, dtype=gate.dtype)
    n = gate.shape[-1]
    odd = compiled.library()[0].ptq_silu_mul_bf16(gate.data_ptr(), strides[0], up.data_ptr(), strides[1],
                                                   gate.numel() // n, n, silu_table().data_ptr(), int(portable),
                                                   out.data_ptr())
    return out if odd == 0 else None


def _forward(module: nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
    """LlamaMLP.forward with the product compiled where silu_mul applies; the class's own
    forward for another call than x alone, or where calling act_fn would run hooks."""
    if args or kwargs or hooked(module.act_fn):
        return type(module).forward(module, x, *args, **kwargs)
    gate = module.gate_proj(x)
    up = module.up_proj(x)
    product = silu_mul(gate, up)
    return module.down_proj(module.act_fn(gate) * up if product is None else product)


@contextlib.contextmanager
def compiled_products(block: nn.Module) -> Iterator[list[str]]:
    """The block's Llama-style MLPs (applies_to) compute their SiLU-gated products
    compiled while inside (_forward set as the instance's forward); yields their names."""
    names = [name for name, module in block.named_modules() if applies_to(module)]
    modules = [block.get_submodule(name) for name in names]
    if modules:  # made here, on the calling thread, before the passes' threads look it up
        silu_table()
    with instance_forwards([(module, functools.partial(_forward, module)) for module in modules]):
        yield names
