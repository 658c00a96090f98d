"""GPTQ's column loop on a CPU through the compiled gptq_loop.c (built at install when a C
compiler is there; see setup.py), called with ctypes.

The torch loop (gptq._solve) dispatches about ten small ops per column; at SmolLM2's
shapes that was most of the solve time, and on a busy CPU each op is a chance to wait
(issue 15). The compiled loop does a block of columns per call. Rows are independent
given H⁻¹, so a block's rows are split across threads (ctypes lets go of the GIL during
the call): what each row gets is the same for any thread count.

`loop_for` says which loop a solve takes; `unavailable()` why the compiled one cannot be
used, for the report. PTQ_GPTQ_LOOP=torch forces the torch loop.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os

import torch
from torch import Tensor

from ptq.devices import cpu_parallel
from ptq.primitives import MSE_COARSE, MSE_FINE
from ptq.schemes import QuantArgs

ENV = "PTQ_GPTQ_LOOP"  # "torch": always the torch loop
SCALE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MIN_ROWS_PER_THREAD = 64  # fewer rows gain nothing from another thread
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """The loaded library, or None and why not."""
    spec = importlib.util.find_spec("ptq.algorithms._gptq_loop")
    if spec is None or not spec.origin:
        return None, "ptq was installed without its compiled GPTQ loop (no C compiler at install time)"
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as error:
        return None, f"the compiled GPTQ loop does not load: {error}"
    lib.ptq_gptq_block.restype = ctypes.c_int
    lib.ptq_gptq_block.argtypes = [  # rows r0, r1 and positions i1, i2 first: they change per call
        _I, _I, _I, _I, _P, _I, _P, _I, _I, _P, _P, _P, _P, _P, _I, _P, _P, _P,
        ctypes.c_int32, ctypes.c_float, ctypes.c_float, _P, _I, ctypes.c_float,
    ]
    lib.ptq_gptq_has_float16.restype = ctypes.c_int
    return lib, None


def unavailable() -> str | None:
    """Why CPU solves take the torch loop, or None when they take the compiled one."""
    if os.environ.get(ENV, "").lower() == "torch":
        return f"{ENV}=torch is set"
    return _library()[1]


def loop_for(device: torch.device, args: QuantArgs, scale_dtype: torch.dtype) -> str:
    """'compiled' or 'torch': the loop a solve on `device` with these weights takes."""
    if device.type != "cpu" or args.type != "int" or scale_dtype not in SCALE_KINDS or unavailable():
        return "torch"
    if scale_dtype == torch.float16 and not _library()[0].ptq_gptq_has_float16():
        return "torch"
    return "compiled"


class BlockLoop:
    """The compiled loop over one weight: `run(i1, i2)` does the block of positions [i1, i2).

    Wt [cols, R] float32, Hinv [cols, cols] float32 (any strides), E [block, R] and
    Qt [cols, R] int8, all contiguous where not said otherwise; group [cols] the group of each
    position, first [cols] the group fitted at each position (-1: none), members
    [groups, size], importance [cols]; scale, zero [groups, R] float32 (zero None when
    symmetric), filled as groups are fitted.
    """

    def __init__(self, Wt: Tensor, Hinv: Tensor, E: Tensor, Qt: Tensor, group: Tensor, first: Tensor,
                 members: Tensor, importance: Tensor, scale: Tensor, zero: Tensor | None, args: QuantArgs,
                 scale_dtype: torch.dtype, observer: str, threads: int):
        self._lib = _library()[0]
        mse = observer == "mse"
        candidates = torch.tensor(MSE_COARSE if mse else (1.0,), dtype=torch.float32)
        group, first, members = group.long().contiguous(), first.long().contiguous(), members.long().contiguous()
        importance = importance.float().contiguous()
        self._keep = (group, first, members, importance, candidates)  # alive while C reads them
        for t in (Wt, E, Qt, scale) + (() if zero is None else (zero,)):
            assert t.is_contiguous() and t.device.type == "cpu", "the compiled loop takes contiguous CPU tensors"
        rows = Wt.shape[1]
        threads = max(1, min(threads, rows // MIN_ROWS_PER_THREAD))
        edges = [rows * k // threads // 16 * 16 for k in range(threads)] + [rows]
        self._slices = list(zip(edges, edges[1:]))
        self._fixed = (  # ptq_gptq_block's arguments after r0, r1, i1, i2
            Wt.data_ptr(), rows, Hinv.data_ptr(), Hinv.stride(0), Hinv.stride(1), E.data_ptr(), Qt.data_ptr(),
            group.data_ptr(), first.data_ptr(), members.data_ptr(), members.shape[1],
            importance.data_ptr() if mse else None, scale.data_ptr(), None if zero is None else zero.data_ptr(),
            SCALE_KINDS[scale_dtype], float(args.qmin), float(args.qmax), candidates.data_ptr(),
            candidates.numel(), MSE_FINE if mse else 0.0,
        )

    def run(self, i1: int, i2: int) -> None:
        block = self._lib.ptq_gptq_block
        statuses = cpu_parallel([functools.partial(block, r0, r1, i1, i2, *self._fixed) for r0, r1 in self._slices],
                                len(self._slices))
        if any(statuses):
            raise MemoryError("the compiled GPTQ loop ran out of memory for a group's columns")
