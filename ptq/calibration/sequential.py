"""True-sequential quantization of one block, computing each Linear once.

The block's Linears are grouped into stages in execution order, Linears reading the same
input sharing a stage (q/k/v, then o, then gate/up, then down). Stage k is calibrated on
inputs produced by the already-quantized stages before it:

- a pass runs every batch through the block and stops at the stage's first Linear, whose
  input is recorded and fed to the stage's (shared) observer;
- the stage is quantized, and the quantized Linears' outputs are computed once from the
  recorded inputs;
- in later passes those modules are replaced by replays of their outputs, so no Linear
  is computed twice; once every Linear inside a submodule (self_attn, mlp) is quantized,
  the submodule is replayed whole: at once when it returns its last Linear's output as
  is (self_attn returns o_proj's), else from its outputs recorded in the next pass;
- the last stage's pass uses the replays of the Linears feeding it (gate/up) for the last
  time and lets go of each batch's outputs as it goes, so its recorded input (down's)
  takes their place instead of adding to them; the final pass, which gives the block's
  outputs (the next block's inputs), then runs only the glue;
- on a CPU, submodules fed by nothing but the block's own inputs (Llama's input_layernorm)
  give the same outputs in every pass: the first pass keeps them and later passes replay
  them (_BlockInputFed).

The cost per block is about one forward pass of its Linears and a few passes of the glue
between them (attention core, norms), instead of two or more full passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ptq.calibration.observers import Observer
from ptq.calibration.runner import BlockRun, Inputs, _hidden, _StopForward, _with_hidden, run_until_stopped
from ptq.modules import cached_weight


class _Batch:
    """Which batch the calling thread's pass runs (BlockRun.map_batches runs batches on
    several threads at once), and the compute device replayed outputs return to."""

    def __init__(self, device: torch.device):
        self.device = device
        self._local = threading.local()

    @property
    def index(self) -> int:
        return self._local.index

    @index.setter
    def index(self, value: int) -> None:
        self._local.index = value


class _Replay(nn.Module):
    """Stands in for a module whose outputs on the calibration batches are known."""

    def __init__(self, outputs: list, batch: _Batch, last_use: bool = False):
        super().__init__()
        self.outputs = outputs
        self.batch = batch
        self.last_use = last_use  # no later pass replays these: hand each over and forget it

    def forward(self, *_args, **_kwargs):
        if self.last_use:
            output, self.outputs[self.batch.index] = self.outputs[self.batch.index], None
            return _fetch(output, self.batch.device, copy=False)
        # a copy, so in-place ops downstream cannot corrupt what the next pass replays
        return _fetch(self.outputs[self.batch.index], self.batch.device, copy=True)


def _fetch(value, device: torch.device, copy: bool):
    """value's tensors on device (kept on the CPU while activations wait there: see
    ptq.calibration.runner.activation_device); copies, unless copy is False and they are
    on device already."""
    def one(t: Tensor) -> Tensor:
        if t.device != device:
            return t.to(device)
        return t.clone() if copy else t

    return _map_tensors(one, value)


def _kept(value, run: BlockRun):
    """value's tensors where the run's activations wait between passes."""
    return _map_tensors(run.keep, value)


def _map_tensors(fn, value):
    """value (a tensor, a tuple of them, or anything else) with fn applied to its tensors."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(_map_tensors(fn, v) for v in value)
    return value


PLAIN = (type(None), bool, int, float, str)  # arguments that cannot carry another pass's values


def _tensor_ids(value, ids: set[int]) -> bool:
    """Whether every tensor in value (an argument: a tensor, tuple, list or dict of them)
    is one of `ids` and everything else is PLAIN."""
    if isinstance(value, Tensor):
        return id(value) in ids
    if isinstance(value, (tuple, list)):
        return all(_tensor_ids(v, ids) for v in value)
    if isinstance(value, dict):
        return all(_tensor_ids(v, ids) for v in value.values())
    return isinstance(value, PLAIN)


def _collect_ids(value, ids: set[int]) -> set[int]:
    if isinstance(value, Tensor):
        ids.add(id(value))
    elif isinstance(value, (tuple, list)):
        for v in value:
            _collect_ids(v, ids)
    elif isinstance(value, dict):
        for v in value.values():
            _collect_ids(v, ids)
    return ids


class _BlockInputFed:
    """The submodules with no target Linear inside that, in a pass, are called once per
    batch with nothing but the block's own input tensors (the very objects the block was
    called with) and plain values: Llama's input_layernorm. Every pass of the block gives
    them the same inputs, so their outputs in the first pass are kept (copies: something
    downstream may change them in place) and replayed in the passes after it. On Llama-like
    blocks this saves 4 of the 8 RMSNorms per layer and batch (RMSNorm's float32 round
    trips cost about half a millisecond per 512 tokens of SmolLM2's width here)."""

    def __init__(self, block: nn.Module, linears: dict[str, nn.Linear]):
        def has_linear(name: str) -> bool:  # the block ("") has them all
            return not name or any(n == name or n.startswith(name + ".") for n in linears)

        self.candidates = {  # the largest submodules without a target Linear
            name: module for name, module in block.named_modules()
            if not has_linear(name) and has_linear(name.rpartition(".")[0])
        }
        self.outputs: dict[str, list] = {name: [] for name in self.candidates}
        self.record = threading.local()

    def start(self, args: tuple, kwargs: dict) -> None:
        """A batch's pass begins on this thread, calling the block with args and kwargs."""
        self.record.ids = _collect_ids(kwargs, _collect_ids(args, set()))
        self.record.outputs = {}

    def taken(self) -> dict[str, object]:
        """The outputs this thread's batch gave its candidates (None: not fed by block inputs)."""
        return self.record.outputs

    def hooks(self) -> list:
        def hook(name: str):
            def take(_module, args, kwargs, output):
                seen = self.record.outputs
                fed = name not in seen and _tensor_ids(args, self.record.ids) and _tensor_ids(kwargs, self.record.ids)
                seen[name] = _map_tensors(Tensor.clone, output) if fed else None
            return take

        return [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in self.candidates.items()]

    def add(self, taken: dict[str, object], run: BlockRun) -> None:
        """One batch's outputs, batches in order."""
        for name, outputs in self.outputs.items():
            outputs.append(None if taken.get(name) is None else _kept(taken[name], run))

    def replays(self) -> dict[str, list]:
        """Outputs by submodule, for those fed by the block's inputs in every batch."""
        return {name: outputs for name, outputs in self.outputs.items() if all(o is not None for o in outputs)}


@dataclass(frozen=True)
class Stages:
    stages: list[list[str]]  # in execution order; a stage's Linears read the same input
    never_called: list[str]  # target Linears the block's forward does not use
    called_once: bool  # every Linear ran once per forward pass (replaying needs that)
    # submodule -> (the Linear whose output it returns, length of the tuple it returns
    # with that output first and None after it; 0 when it returns the tensor itself)
    returns: dict[str, tuple[str, int]]


@torch.no_grad()
def execution_stages(run: BlockRun, linears: dict[str, nn.Linear]) -> Stages:
    """Group the Linears by one forward pass of the first batch through the block, and
    note which submodules return a Linear's output as it is (self_attn returns o_proj's)."""
    calls: list[tuple[str, Tensor]] = []
    outputs: dict[str, object] = {}
    handles = [
        m.register_forward_pre_hook(lambda _m, args, name=n: calls.append((name, args[0])))
        for n, m in linears.items()
    ]
    for name in {a for n in linears for a in _ancestors(n)} | set(linears):
        handles.append(run.block.get_submodule(name).register_forward_hook(
            lambda _m, _a, out, name=name: outputs.setdefault(name, out)
        ))
    try:
        args, kwargs = run.inputs[0]
        run.block(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    stages: list[list[str]] = []
    previous = None
    for name, x in calls:
        if any(name in stage for stage in stages):
            continue
        if stages and x is previous:
            stages[-1].append(name)
        else:
            stages.append([name])
        previous = x
    once = len(calls) == len({name for name, _ in calls})
    missing = [n for n in linears if not any(n in stage for stage in stages)]
    return Stages(stages, missing, once, _returned_linears(outputs, linears))


def _returned_linears(outputs: dict[str, object], linears: dict[str, nn.Linear]) -> dict[str, tuple[str, int]]:
    returns = {}
    for name, out in outputs.items():
        if name in linears:
            continue
        first, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        inner = [n for n in linears if n.startswith(name + ".") and outputs.get(n) is first]
        if inner and all(r is None for r in rest):
            returns[name] = (inner[0], len(out) if isinstance(out, tuple) else 0)
    return returns


@contextmanager
def _replaying(
    block: nn.Module, replays: dict[str, list], batch: _Batch, last_use: frozenset[str] = frozenset()
) -> Iterator[None]:
    originals = {name: block.get_submodule(name) for name in replays}
    for name, outputs in replays.items():
        block.set_submodule(name, _Replay(outputs, batch, last_use=name in last_use))
    try:
        yield
    finally:
        for name, module in originals.items():
            block.set_submodule(name, module)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _complete(name: str, linears: dict[str, nn.Linear], done: set[str]) -> bool:
    """The submodule is not replayed whole yet, and every target Linear in it is quantized."""
    inside = [n for n in linears if n.startswith(name + ".")]
    return name not in done and bool(inside) and all(n in done for n in inside)


def _replay_whole(replays: dict[str, list], done: set[str], name: str, outputs: list) -> None:
    """Replay the submodule from its outputs instead of the Linears inside it."""
    for inner in [n for n in replays if n.startswith(name + ".")]:
        del replays[inner]
    replays[name] = outputs
    done.add(name)


def _complete_ancestors(replays: dict[str, list], linears: dict[str, nn.Linear], done: set[str]) -> list[str]:
    """Submodules all of whose target Linears are quantized and not yet replayed whole."""
    found = [name for name in {a for n in replays for a in _ancestors(n)} if _complete(name, linears, done)]
    return sorted(found, key=len)


@torch.no_grad()
def quantize_block_sequentially(
    run: BlockRun,
    order: Stages,
    linears: dict[str, nn.Linear],
    make_observer: Callable[[], Observer],
    quantize: Callable[[list[str], Observer], dict[str, nn.Module]],
) -> Inputs:
    """Quantize the stages in order (quantize(stage, observer) quantizes the stage's
    Linears, which share that observer, and returns the installed modules by name);
    return the block's outputs computed with the quantized Linears."""
    stages = order.stages
    batch = _Batch(device=next(run.block.parameters()).device)
    replays: dict[str, list] = {}
    done: set[str] = set()
    # on an accelerator the glue is cheap and memory dear: nothing extra is kept there
    fed = _BlockInputFed(run.block, linears) if batch.device.type == "cpu" and len(stages) > 1 else None
    for i, stage in enumerate(stages):
        last = i == len(stages) - 1
        observer = make_observer()
        recorded: list[Tensor] = []
        pending = _complete_ancestors(replays, linears, done)
        # Memory: in the last stage's pass, the outputs of single Linears still replayed
        # (gate/up) are needed for the last time; each batch's go as its input is recorded
        last_use = frozenset(name for name in replays if name in linears) if last else frozenset()
        outputs = _stage_pass(run, linears[stage[0]], replays, pending, batch, observer, recorded, last_use,
                              fed if i == 0 else None)
        if i == 0 and fed is not None:
            replays.update(fed.replays())
        for name in last_use:
            del replays[name]
        _coarsen(replays, pending, outputs, done, len(run.inputs))
        for name, module in quantize(stage, observer).items():
            with cached_weight(module):
                replays[name] = run.map_items(lambda x, module=module: _kept(module(x.to(batch.device)), run), recorded)
            done.add(name)
        del recorded
        _replay_returning_modules(replays, order.returns, linears, done)

    def final(index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        batch.index = index
        return _with_hidden(args, kwargs, run.keep(_hidden(run.block(*args, **kwargs))))

    with _replaying(run.block, replays, batch), cached_weight(run.block):
        return list(run.map_batches(final))


def _replay_returning_modules(
    replays: dict[str, list], returns: dict[str, tuple[str, int]], linears: dict[str, nn.Linear], done: set[str]
) -> None:
    """A submodule that returns its last Linear's output (self_attn returns o_proj's) is
    replayed whole as soon as all its Linears are quantized: no pass recomputes it."""
    for name, (linear, length) in sorted(returns.items(), key=lambda item: len(item[0])):
        if linear in replays and _complete(name, linears, done):
            outputs = [(out,) + (None,) * (length - 1) if length else out for out in replays[linear]]
            _replay_whole(replays, done, name, outputs)


def _stage_pass(
    run, first: nn.Module, replays, pending, batch, observer, recorded, last_use, fed: _BlockInputFed | None = None
) -> dict[str, list]:
    """One pass over the batches that observes and records the stage's input, and records
    the outputs of the pending submodules (and fed's candidates); replays named in last_use
    are emptied. Batches may run side by side (BlockRun.map_batches): what each records is
    taken batch by batch in order on this thread."""
    outputs: dict[str, list] = {name: [] for name in pending}
    record = threading.local()  # the calling thread's batch: its stage input, pending outputs

    def take_input(_module, args):
        record.input = args[0]
        raise _StopForward

    def one(index: int, args: tuple, kwargs: dict) -> tuple[Tensor | None, dict, dict]:
        batch.index, record.input, record.outputs = index, None, {}
        if fed is not None:
            fed.start(args, kwargs)
        run_until_stopped(run.block, *args, **kwargs)
        return record.input, record.outputs, fed.taken() if fed is not None else {}

    with _replaying(run.block, replays, batch, last_use):
        handles = [first.register_forward_pre_hook(take_input)]
        handles += [
            run.block.get_submodule(name).register_forward_hook(
                lambda _m, _a, out, name=name: record.outputs.setdefault(name, out)
            )
            for name in pending
        ]
        handles += fed.hooks() if fed is not None else []
        try:
            for x, outs, taken in run.map_batches(one):
                if fed is not None:
                    fed.add(taken, run)
                for name, out in outs.items():
                    outputs[name].append(_kept(out, run))
                if x is not None:
                    recorded.append(run.keep(x))
                    observer.update(x)
        finally:
            for handle in handles:
                handle.remove()
    return outputs


def _coarsen(
    replays: dict[str, list], pending: list[str], outputs: dict[str, list], done: set[str], batches: int
) -> None:
    """Replay whole submodules whose outputs were recorded for every batch."""
    for name in pending:
        if any(name.startswith(other + ".") for other in pending if other != name):
            continue  # an enclosing module is replayed instead
        if len(outputs[name]) != batches:
            continue  # it did not finish before the pass stopped
        _replay_whole(replays, done, name, outputs[name])
