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

from ptq.devices import bf16_valued_gemms_exact, cpu_parallel, float32_gemms
from ptq.distributed import all_reduce_, all_reduce_count


class Observer:
    """Accumulates a statistic of x [..., in_features] over calibration batches."""

    def update(self, x: Tensor) -> None:
        raise NotImplementedError

    @property
    def value(self) -> Tensor:
        raise NotImplementedError


class HessianObserver(Observer):
    """H = 2/N · Σ x xᵀ over all N tokens seen: float32 [in, in].

    H is symmetric: the features are split into blocks of about BLOCK and only the blocks
    on and above the diagonal are accumulated (with 11 blocks, 66 of 121: 45% fewer FLOPs);
    the others are mirrored when H is read.

    bf16 inputs on a CPU with fast bf16 GEMMs are converted to float32 and multiplied in
    bf16 (devices.float32_gemms): the products of bf16 values are exact and their sums
    float32, so H is as accurate as a float32 GEMM makes it, at 2.7x its speed here (and
    1.6x the speed of the two bf16 GEMMs, product and rounding error, used before).

    On a CPU each row of blocks is one GEMM on one thread, the rows spread over the threads
    (devices.cpu_parallel), so that H does not depend on the thread count: MKL and oneDNN
    split a GEMM's long sums across threads, rounding differently for each count (float32:
    2048 tokens differ between 1 and 2 threads; bf16: 1024 tokens between 1 and 3). On
    SmolLM2's and Llama's shapes this is 2 to 4 times faster than the threaded GEMMs over
    512-token chunks it replaced, whose threads synchronised for every small GEMM (issue
    15). Batches are gathered (copied) up to PENDING_TOKENS tokens first, for longer GEMMs.
    On a GPU, where a sum does not depend on a thread count, each batch's GEMMs run in turn.
    """

    BLOCK = 256
    PENDING_TOKENS = 2048  # on a CPU, tokens gathered before the GEMMs run (fewer, longer ones)
    PENDING_BYTES = 64 * 2**20  # at most, for wide inputs

    def __init__(self) -> None:
        self.sum: Tensor | None = None
        self.tokens = 0
        self._value: Tensor | None = None
        self._pending: Tensor | None = None  # [cap, in] float32: inputs not yet in the sum (CPU)
        self._filled = 0
        self._bf16_values = False  # the pending inputs are bf16 values: float32_gemms("bf16")

    def _edges(self, n: int) -> list[int]:
        blocks = max(1, n // self.BLOCK)
        return [n * b // blocks for b in range(blocks + 1)]

    def update(self, x: Tensor) -> None:
        if self._value is not None:
            raise RuntimeError("this Hessian was read already; use a new observer for more batches")
        flat = x.reshape(-1, x.shape[-1])  # [tokens, in]
        self.tokens += flat.shape[0]
        if flat.device.type != "cpu":
            self._accumulate(flat.float())
            return
        if self._pending is None:  # copies, not references: a caller may reuse x's memory
            cap = max(1, min(self.PENDING_TOKENS, self.PENDING_BYTES // (4 * flat.shape[1])))
            self._pending = torch.empty(cap, flat.shape[1])
            self._bf16_values = _bf16_valued(flat)
        cap, start = self._pending.shape[0], 0
        while start < flat.shape[0]:
            take = min(cap - self._filled, flat.shape[0] - start)
            self._pending[self._filled:self._filled + take] = flat[start:start + take]
            self._filled, start = self._filled + take, start + take
            if self._filled == cap:
                self._flush()

    def _flush(self) -> None:
        if self._filled:
            self._accumulate(self._pending[: self._filled])
        self._filled = 0

    def _accumulate(self, flat: Tensor) -> None:
        """sum += flatᵀ flat for flat [tokens, in] float32."""
        n = flat.shape[1]
        if self.sum is None:
            self.sum = torch.zeros(n, n, dtype=torch.float32, device=flat.device)
        edges = self._edges(n)
        rows = [functools.partial(self._add_rows, flat, a, b) for a, b in zip(edges, edges[1:])]
        if flat.device.type != "cpu":
            for add in rows:
                add()
            return
        with float32_gemms("bf16" if self._bf16_values else "ieee"):
            cpu_parallel(rows, torch.get_num_threads())

    def _add_rows(self, flat: Tensor, a: int, b: int) -> None:
        """The row of blocks [a, b) from the diagonal on: sum[a:b, a:] += flat[:, a:b]ᵀ flat[:, a:]."""
        self.sum[a:b, a:].addmm_(flat[:, a:b].t(), flat[:, a:])

    @property
    def value(self) -> Tensor:
        """H, made from the running sum in place the first time it is read (no second
        [in, in] matrix: they are large); the observer takes no batches after that."""
        if self._value is None:
            if self._pending is not None:
                self._flush()
                self._pending = None
            assert self.sum is not None, "no calibration batch reached this Linear"
            self.tokens = all_reduce_count(self.tokens)  # now of every process: their sums add up
            H = all_reduce_(self.sum).mul_(2.0 / self.tokens)
            edges = self._edges(H.shape[0])
            for a, b in zip(edges[1:-1], edges[2:]):
                H[a:b, :a] = H[:a, a:b].t()
            self._value, self.sum = H, None
        return self._value


def _bf16_valued(x: Tensor) -> bool:
    """Whether x xᵀ runs as bf16-valued GEMMs (see HessianObserver)."""
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and bf16_valued_gemms_exact()


class AbsMaxObserver(Observer):
    """max |x| per input channel: float32 [in]."""

    def __init__(self) -> None:
        self.max: Tensor | None = None
        self._reduced = False

    def update(self, x: Tensor) -> None:
        current = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        self.max = current if self.max is None else torch.maximum(self.max, current)

    @property
    def value(self) -> Tensor:
        assert self.max is not None, "no calibration batch reached this Linear"
        if not self._reduced:
            self.max, self._reduced = all_reduce_(self.max, "max"), True
        return self.max


class MeanAbsObserver(Observer):
    """mean |x| per input channel: float32 [in]."""

    def __init__(self) -> None:
        self.sum: Tensor | None = None
        self.tokens = 0
        self._reduced = False

    def update(self, x: Tensor) -> None:
        flat = x.reshape(-1, x.shape[-1])
        current = flat.abs().float().sum(dim=0)
        self.sum = current if self.sum is None else self.sum + current
        self.tokens += flat.shape[0]

    @property
    def value(self) -> Tensor:
        assert self.sum is not None, "no calibration batch reached this Linear"
        if not self._reduced:
            self.sum, self.tokens, self._reduced = all_reduce_(self.sum), all_reduce_count(self.tokens), True
        return self.sum / self.tokens


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
