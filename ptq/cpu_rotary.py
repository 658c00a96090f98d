"""The calibration passes' rotary position embeddings on a CPU: compiled (ptq/cpu_rotary.c) in
place of transformers' apply_rotary_pos_emb (Llama's: q · cos + rotate_half(q) · sin), which
stays the reference (tests compare the two bit for bit).

torch computes it in five passes over q and five over k (the two products, the halves'
concatenation with one negated, the sum), each writing a new tensor; the compiled one reads
each row once and writes it once, in the same steps and roundings (bf16 or float32). One
thread of a 2-core Xeon (AMX) VM, q and k of a batch, ms compiled / torch: SmolLM2's 8 x 256
tokens (9 query and 3 key heads of 64) 0.62-0.69 / 2.26-2.52 in bf16, 1.7-2.1 / 3.8-8.7 in
float32; the bundled model's 4 x 512 (8 and 2 heads of 32) 0.27-0.28 / 1.33-1.37 in bf16.
GPTQ, alternating runs: SmolLM2-shaped 5.60-5.74 against 5.85-6.00 s, bundled 0.51-0.52
against 0.54-0.55 s, the same checkpoints.

An attention module takes it where its class's forward calls a function named
apply_rotary_pos_emb from its module's globals that computes Llama's rotary: the same bits
as the compiled one on probes of random heads (bf16 and float32, cos and sin for each
sample or one for all), found once per function. Its forward then runs as a copy of the
class's own code (glue.with_globals: decorators kept) whose apply_rotary_pos_emb is
`_apply`: the compiled rotary for what it covers, the module's own function for anything
else (another unsqueeze_dim, partial rotary with cos narrower than a head, other dtypes or
devices, autograd, a non-finite result, hooks on a function that is a module). Nothing of
the model changes: the copy is set on the instance while a block's passes run
(glue.instance_forwards), none where the instance has a forward of its own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from ptq.algorithms import compiled
from ptq.glue import hooked, instance_forwards, with_globals

NAME = "apply_rotary_pos_emb"  # what transformers' attention forwards call
DTYPES = (torch.bfloat16, torch.float32)


def rotary(x: Tensor, cos: Tensor, sin: Tensor, portable: bool = False) -> Tensor | None:
    """x · cos + rotate_half(x) · sin, cos and sin unsqueezed at dim 1, as transformers'
    Llama code computes it, for x [batch, heads, seq, dim] and cos, sin [batch or 1, seq, dim]
    (bf16 or float32, all one dtype, on a CPU, unit stride along dim); the result has x's
    strides, as torch's has. None where that does not hold, where bf16 would not take the
    AVX-512 code (a CPU without it, or half a head not a multiple of 16: the portable loop
    is slower than torch's) or a result is not finite. portable: not the AVX-512 code (the
    same bits: for tests)."""
    applies = (
        x.device.type == cos.device.type == sin.device.type == "cpu" and x.dtype in DTYPES
        and x.dtype == cos.dtype == sin.dtype and x.dim() == 4 and cos.dim() == 3
        and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.shape[0] in (1, x.shape[0])
        and tuple(cos.shape[1:]) == (x.shape[2], x.shape[3]) and x.shape[3] % 2 == 0
        and x.stride(3) == 1 and cos.stride(2) == 1
        and not (torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad))
    )
    if not applies or compiled.unavailable() is not None:
        return None
    # bf16 takes the AVX-512 code (16 lanes of each half): the portable loop is slower than torch
    wide = x.shape[3] // 2 % 16 == 0 and compiled.linalg_kind() == "AVX-512"
    if x.dtype == torch.bfloat16 and not (wide or portable):
        return None
    out = torch.empty_like(x)  # x's strides where x is dense (a transposed view of the projection)
    if out.stride(3) != 1:
        out = torch.empty(x.shape, dtype=x.dtype)
    batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    odd = compiled.library()[0].ptq_rotary(
        x.data_ptr(), *x.shape, *x.stride()[:3], cos.data_ptr(), sin.data_ptr(), batch_stride, cos.stride(1),
        int(x.dtype == torch.float32), int(portable), out.data_ptr(), *out.stride()[:3])
    return out if odd == 0 else None


def _apply(original: Callable, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *args, **kwargs):
    """apply_rotary_pos_emb(q, k, cos, sin[, unsqueeze_dim=1]) compiled where rotary applies
    to both, else the module's own function `original`."""
    # a fifth argument by position is position_ids in older transformers: theirs to take
    default = not args and kwargs in ({}, {"unsqueeze_dim": 1})
    if default and not (isinstance(original, nn.Module) and hooked(original)):
        q_embed = rotary(q, cos, sin)
        k_embed = None if q_embed is None else rotary(k, cos, sin)
        if k_embed is not None:
            return q_embed, k_embed
    return original(q, k, cos, sin, *args, **kwargs)


@functools.cache
def computes_llama_rotary(function: Callable) -> bool:
    """Whether function(q, k, cos, sin) gives the compiled rotary's bits on probes: random
    heads of 64 (bf16 and float32; strided, as a projection's view), cos and sin for each
    sample and one row for all. The portable code answers (the same bits as the AVX-512
    code): a CPU without AVX-512 recognises the function too, for its float32 passes."""
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for cos_batch in (2, 1):
            q = torch.randn(2, 5, 3 * 64, generator=g).to(dtype).view(2, 5, 3, 64).transpose(1, 2)
            k = torch.randn(2, 1, 5, 64, generator=g).to(dtype)
            angles = torch.rand(cos_batch, 5, 64, generator=g) * 6.3
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            try:
                with torch.no_grad():
                    got = function(q, k, cos, sin)
            except Exception:  # another signature or computation: not Llama's
                return False
            if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, Tensor) for t in got)):
                return False
            ours = rotary(q, cos, sin, portable=True), rotary(k, cos, sin, portable=True)
            if not all(o is not None and o.shape == t.shape and o.dtype == t.dtype and torch.equal(o, t)
                       for o, t in zip(ours, got)):
                return False
    return True


def compiled_forward(module: nn.Module) -> Callable | None:
    """module's forward with the compiled rotary (a copy of its class's code, bound to it), or
    None where the module's forward does not call a Llama rotary by that name, the instance
    has a forward of its own, or the compiled library does not run here."""
    if "forward" in vars(module) or compiled.unavailable() is not None:
        return None
    function = getattr(type(module), "forward", None)
    code = getattr(inspect.unwrap(function), "__code__", None) if function is not None else None
    if code is None or NAME not in code.co_names:
        return None
    original = inspect.unwrap(function).__globals__.get(NAME)
    if original is None or not computes_llama_rotary(original):
        return None
    # copied afresh for each block's passes: the copy sees its module's globals as they are now
    replaced = with_globals(function, {NAME: functools.partial(_apply, original)})
    return None if replaced is None else types.MethodType(replaced, module)


@contextlib.contextmanager
def compiled_rotary(block: nn.Module) -> Iterator[int]:
    """The block's attention modules apply their rotary embeddings compiled while inside
    (compiled_forward set as the instance's forward); yields how many."""
    found = [(m, f) for m in block.modules() if (f := compiled_forward(m)) is not None]
    with instance_forwards(found):
        yield len(found)
