"""The true-sequential engine's memory of a block's norms across its passes (Memo), and
which batch each thread's pass runs (Batch): see ptq.calibration.sequential, whose passes
compute Llama's input_layernorm once per batch instead of once per pass, and a norm whose
output is a stage's input only in that stage's pass."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ptq import cpu_norm


class Batch:
    """Which batch the calling thread's pass runs and with which block inputs
    (BlockRun.map_batches runs batches on several threads at once), and the compute device
    replayed outputs return to."""

    def __init__(self, device: torch.device):
        self.device = device
        self._local = threading.local()
        self.last_pass = False  # the block's final pass runs: claimed norm outputs are handed over and forgotten

    @property
    def index(self) -> int:
        return self._local.index

    def begin(self, index: int, args: tuple, kwargs: dict) -> None:
        """This thread's pass runs batch `index`, calling the block with args and kwargs."""
        self._local.index = index
        self._local.inputs = {id(t) for t in _tensors((args, kwargs))}
        self._local.called = set()

    def first_call(self, module: nn.Module) -> bool:
        """Whether this is module's first call in this thread's pass of its batch (False
        outside the engine's passes)."""
        called = getattr(self._local, "called", None)
        if called is None or id(module) in called:
            return False
        called.add(id(module))
        return True

    def from_block_inputs(self, value) -> bool:
        """Whether value's tensors are all among the block call's own (the very objects)."""
        inputs = getattr(self._local, "inputs", set())
        return all(id(t) in inputs for t in _tensors(value))


PLAIN = (type(None), bool, int, float, str)  # arguments compared by value; others make no memo


def _tensors(value) -> list[Tensor]:
    """The tensors in value, through tuples, lists and dicts, in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _versions(value) -> list[int]:
    """The version counters of value's tensors: an in-place change to one raises its count."""
    return [t._version for t in _tensors(value)]


def _plain(value) -> bool:
    """Whether value holds nothing but tensors and PLAIN values (through tuples, lists, dicts)."""
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    return isinstance(value, (Tensor, *PLAIN))


class Memo(nn.Module):
    """Stands in for one of the block's norms (see memoized) through the engine's passes,
    so that a pass does not compute again what an earlier one did, in two ways:

    - called on a batch with nothing but the block's own input tensors (the very objects the
      block was called with) and plain values, it keeps its output, and returns it when a
      later pass calls it again with the same objects and values, none changed in place
      since (tensor version counters). Every pass computes Llama's input_layernorm from the
      block's input: it is computed once per batch instead of five times;
    - when its output was a stage's recorded input (Llama's post_attention_layernorm's, the
      gate/up stage's), the engine claims it (claim): the later passes get it back at their
      first call of the module, unless it was changed in place since. Their norm reads a
      residual sum made anew in each pass, of the same values: a pass's input to a stage
      depends only on the block's inputs and the stages before it, whose outputs the later
      passes replay. In Llama it feeds only gate/up's replays there; it was computed in
      three passes (about 3 ms per 2048 tokens of SmolLM2's width, one thread, in place).

    Nothing is copied, and only outputs that would otherwise be recomputed are kept: about
    one hidden-sized tensor per batch while the block runs for each, the first as the q/k/v
    stage's recorded input, the second as gate/up's, kept until the final pass uses it.

    What it does compute, a Llama-style RMSNorm computes compiled on a CPU (ptq.cpu_norm:
    the same bits as transformers' forward, fewer passes over the activations)."""

    def __init__(self, module: nn.Module, batch: Batch, batches: int):
        super().__init__()
        self.inner = module
        self.compiled = cpu_norm.compiled_forward(module)  # None unless a Llama-style RMSNorm
        self.batch = batch
        self.calls: list[tuple | None] = [None] * batches  # per batch: inputs, output, their versions
        self.latest: list[weakref.ref | None] = [None] * batches  # per batch: the output of a pass's first call
        self.claimed: list[tuple[Tensor, int] | None] = [None] * batches  # per batch: output and version

    def forward(self, *args, **kwargs):
        i = self.batch.index
        first = self.batch.first_call(self)
        output = self._claimed(i) if first else None
        if output is None:
            output = self._remembered(i, args, kwargs)
        if first:
            self.latest[i] = weakref.ref(output) if isinstance(output, Tensor) else None
        return output

    def _claimed(self, i: int) -> Tensor | None:
        """The claimed output of batch i, unless changed in place since (then forgotten);
        forgotten after the final pass takes it."""
        if self.claimed[i] is None:
            return None
        output, version = self.claimed[i]
        unchanged = output._version == version
        if not unchanged or self.batch.last_pass:
            self.claimed[i] = None
        return output if unchanged else None

    def _remembered(self, i: int, args: tuple, kwargs: dict):
        last = self.calls[i]
        if last is not None:
            inputs, output, versions = last
            if _identical((args, kwargs), inputs) and _versions((inputs, output)) == versions:
                return output
        output = self.compiled(args[0]) if self.compiled and len(args) == 1 and not kwargs else None
        if output is None:
            output = self.inner(*args, **kwargs)
        kept = _plain((args, kwargs)) and _plain(output) and self.batch.from_block_inputs((args, kwargs))
        self.calls[i] = ((args, kwargs), output, _versions(((args, kwargs), output))) if kept else None
        return output

    def claim(self, i: int, x: Tensor) -> bool:
        """Keep x, a stage's recorded input of batch i, for the later passes' first call, if
        it is this pass's output of the first call (then True)."""
        if self.latest[i] is None or self.latest[i]() is not x:
            return False
        self.claimed[i] = (x, x._version)
        return True


def _identical(a, b) -> bool:
    """Whether arguments a and b hold the very same tensors and equal plain values."""
    if isinstance(a, (tuple, list, dict)) or isinstance(b, (tuple, list, dict)):
        if type(a) is not type(b) or len(a) != len(b):
            return False
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
        return all(_identical(x, y) for x, y in zip(a, b))
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return type(a) is type(b) and a == b


@contextmanager
def memoized(block: nn.Module, linears: dict[str, nn.Linear], batch: Batch, batches: int
              ) -> Iterator[list[Memo]]:
    """The block's children with parameters but no target Linear (norms, not activation
    functions: those cost little to recompute and their inputs are wide) stand in as Memo
    while the block runs (yielded)."""
    names = [
        name for name, child in block.named_children()
        if not any(n.startswith(name + ".") or n == name for n in linears) and any(True for _ in child.parameters())
    ]
    originals = {name: block.get_submodule(name) for name in names}
    memos = [Memo(module, batch, batches) for module in originals.values()]
    for name, memo in zip(originals, memos):
        block.set_submodule(name, memo)
    try:
        yield memos
    finally:
        for name, module in originals.items():
            block.set_submodule(name, module)
