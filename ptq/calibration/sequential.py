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
- a replay is copied (against in-place ops downstream) only for a pass that a later one
  follows reading it again: its last pass hands each batch's outputs over and lets go of
  them as it goes (q/k/v's in o's pass, gate/up's in the last stage's, whose recorded
  input, down's, takes their place instead of adding to them; every replay in the final
  pass, which gives the block's outputs, the next block's inputs, running only the glue);
- on a CPU, the block's norms that read nothing but the block's own input (Llama's
  input_layernorm) are computed in the first pass only, and a norm whose output is a
  stage's input (post_attention_layernorm) in that stage's pass only (Memo); a
  Llama-style MLP's SiLU-gated product and rotary embeddings are computed compiled
  (ptq.cpu_mlp, ptq.cpu_rotary).

The cost per block is about one forward pass of its Linears and a few passes of the glue
between them (attention core, norms), instead of two or more full passes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ptq import cpu_mlp, cpu_rotary
from ptq.calibration.memo import Batch, Memo, memoized
from ptq.calibration.observers import Observer
from ptq.calibration.runner import (BlockRun, Inputs, _hidden, _hidden_of, _StopForward, _with_hidden,
                                   run_until_stopped)
from ptq.devices import cpu_budget, cpu_threads
from ptq.glue import global_hooks, runs_llama_code
from ptq.modules import cached_weight, stacked


class _Replay(nn.Module):
    """Stands in for a module whose outputs on the calibration batches are known."""

    def __init__(self, outputs: list, batch: Batch, last_use: bool = False, read_only: bool = False):
        super().__init__()
        self.outputs = outputs
        self.batch = batch
        self.last_use = last_use  # no later pass replays these: hand each over and forget it
        self.read_only = read_only  # what calls it only reads its output (_read_only): no copy

    def forward(self, *_args, **_kwargs):
        if self.last_use:
            output, self.outputs[self.batch.index] = self.outputs[self.batch.index], None
            return _fetch(output, self.batch.device, copy=False)
        # else a copy, so that in-place ops downstream cannot corrupt what the next pass replays
        return _fetch(self.outputs[self.batch.index], self.batch.device, copy=not self.read_only)


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


@dataclass(frozen=True)
class Stages:
    stages: list[list[str]]  # in execution order; a stage's Linears read the same input
    never_called: list[str]  # target Linears the block's forward does not use
    called_once: bool  # every Linear ran once per forward pass (replaying needs that)
    # submodule -> (the Linear whose output it returns, length of the tuple it returns
    # with that output first and None after it; 0 when it returns the tensor itself)
    returns: dict[str, tuple[str, int]]

    def called_in_order(self, linears: dict[str, nn.Module]) -> list[nn.Module] | None:
        """linears' modules in the order the block calls them, each once; None where one runs
        more than once (the order of a block's Linears alone: ptq.smoothing stops there)."""
        return [linears[name] for stage in self.stages for name in stage] if self.called_once else None


@torch.no_grad()
def execution_stages(run: BlockRun, linears: dict[str, nn.Linear]) -> Stages:
    """Group the Linears by one forward pass of the first batch's first sample through the
    block (on every core ptq may use: it runs alone, and its outputs are dropped), and note
    which submodules return a Linear's output as it is (self_attn returns o_proj's)."""
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
    whole = run.inputs[0]
    one = _first_sample(*whole)
    try:
        with cpu_threads(cpu_budget()):
            try:
                args, kwargs = one or whole
                run.block(*args, **kwargs)
            except Exception:
                if one is None:  # not cut: the block's own error
                    raise
                calls.clear()  # a per-sample input the cut could not see (inside an object): the whole batch
                outputs.clear()
                run.block(*whole[0], **whole[1])
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


def _first_sample(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A block's inputs for a batch, cut to its first sample: every tensor of two or more
    dimensions whose first is the batch's samples (the hidden states, a padding mask,
    per-sample positions), in tuples, lists and dicts too; None (no cut) where the batch is
    one sample, or as many samples as positions (a [positions, dim] table could not be told
    from a per-sample one)."""
    samples, positions = _hidden_of(args, kwargs).shape[:2]
    if samples in (1, positions):
        return None

    def first(value):
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[0] == samples:
            return value[:1]
        if type(value) in (tuple, list):
            return type(value)(first(v) for v in value)
        return {k: first(v) for k, v in value.items()} if type(value) is dict else value

    return first(args), {k: first(v) for k, v in kwargs.items()}


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
    block: nn.Module, replays: dict[str, list], batch: Batch, last_use: frozenset[str] = frozenset()
) -> Iterator[None]:
    originals = {name: block.get_submodule(name) for name in replays}
    read_only = _read_only(block)
    for name, outputs in replays.items():
        block.set_submodule(name, _Replay(outputs, batch, last_use=name in last_use, read_only=name in read_only))
    try:
        yield
    finally:
        for name, module in originals.items():
            block.set_submodule(name, module)


def _read_only(block: nn.Module) -> frozenset[str]:
    """The block's children whose outputs its forward only reads, so that their replays need
    not be copies: a Llama-style decoder layer's self_attn and mlp (its forward is
    transformers' LlamaDecoderLayer code, decorators included: it adds each to the residual
    out of place), unless global hooks, which run on the replays and might change their
    outputs in place, are set. Copying self_attn's output for the gate/up and down_proj
    passes cost about 0.1 s of CPU on the SmolLM2-shaped GPTQ job (2048 x 576 bf16, cold)."""
    if global_hooks() or not runs_llama_code(block, "LlamaDecoderLayer"):
        return frozenset()
    return frozenset(("self_attn", "mlp"))


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
    batch = Batch(device=run.device)
    memo, memos = contextlib.ExitStack(), []
    if batch.device.type == "cpu" and len(order.stages) > 1:  # on an accelerator the glue is cheap and memory dear
        memos = memo.enter_context(memoized(run.block, linears, batch, len(run.inputs)))
        memo.enter_context(cpu_mlp.compiled_products(run.block))
        memo.enter_context(cpu_rotary.compiled_rotary(run.block))
    with memo:
        return _quantize_stages(run, order, linears, make_observer, quantize, batch, memos)


def _quantize_stages(run: BlockRun, order: Stages, linears: dict[str, nn.Linear], make_observer, quantize,
                     batch: Batch, memos: list[Memo]) -> Inputs:
    """quantize_block_sequentially's stages and final pass (its arguments, the batch index
    and the block's norms standing in as Memo)."""
    stages = order.stages
    replays: dict[str, list] = {}
    done: set[str] = set()
    for i, stage in enumerate(stages):
        last = i == len(stages) - 1
        observer = make_observer()
        recorded: list[Tensor] = []
        pending = _complete_ancestors(replays, linears, done)
        last_use = _last_used(replays, order.returns, linears, done, stage, last)
        outputs = _stage_pass(run, linears[stage[0]], replays, pending, batch, observer, recorded, last_use)
        for name in last_use:
            del replays[name]
        for index, x in enumerate(recorded):  # a norm's output is given back to the later passes
            for memo in memos:
                if memo.claim(index, x):
                    break
        _coarsen(replays, pending, outputs, done, len(run.inputs))
        installed = quantize(stage, observer)
        replays.update(_stage_outputs(run, installed, recorded, batch.device))
        done.update(installed)
        del recorded
        _replay_returning_modules(replays, order.returns, linears, done)

    def final(index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        batch.begin(index, args, kwargs)
        return _with_hidden(args, kwargs, run.keep(_hidden(run.block(*args, **kwargs))))

    batch.last_pass = True
    with _replaying(run.block, replays, batch, last_use=frozenset(replays)), cached_weight(run.block):
        return list(run.map_batches(final, bounded=False))


def _stage_outputs(run: BlockRun, installed: dict[str, nn.Module], recorded: list[Tensor],
                   device: torch.device) -> dict[str, list]:
    """Each quantized Linear's outputs on the stage's recorded inputs, by name: one GEMM on
    each input for the stage's Linears where their weights stack (modules.stacked: q/k/v,
    gate/up), its outputs' columns cut apart as views; else one module at a time."""
    if recorded and (weights := stacked(list(installed.values()), device)) is not None:
        widths = [module.out_features for module in installed.values()]
        weight, bias = (t if t is None else t.to(recorded[0].dtype) for t in weights)  # as each forward casts

        def outputs(x: Tensor) -> tuple[Tensor, ...]:
            return _kept(F.linear(x.to(device), weight, bias), run).split(widths, dim=-1)

        per_input = run.map_items(outputs, recorded)
        return {name: [outs[i] for outs in per_input] for i, name in enumerate(installed)}
    replays = {}
    for name, module in installed.items():
        with cached_weight(module):
            replays[name] = run.map_items(lambda x, module=module: _kept(module(x.to(device)), run), recorded)
    return replays


def _last_used(replays: dict[str, list], returns: dict[str, tuple[str, int]], linears: dict[str, nn.Linear],
               done: set[str], stage: list[str], last: bool) -> frozenset[str]:
    """The replayed single Linears that no pass after this stage's reads, so that this pass
    hands each batch's outputs over instead of copying them, and lets them go as it goes:
    in the last stage's pass, all of them (gate/up's); before it, those inside a submodule
    replayed whole once the stage is quantized (_replay_returning_modules: q/k/v's in o's
    pass, self_attn's then)."""
    singles = [name for name in replays if name in linears]
    if last:
        return frozenset(singles)
    replayed, after = set(replays) | set(stage), done | set(stage)  # once the stage is quantized
    whole = [name for name, (linear, _) in returns.items() if _returns_whole(name, linear, replayed, linears, after)]
    return frozenset(n for n in singles if any(n.startswith(name + ".") for name in whole))


def _returns_whole(name: str, linear: str, replayed, linears: dict[str, nn.Linear], done: set[str]) -> bool:
    """Whether submodule `name`, which returns `linear`'s output as is, is to be replayed
    whole: that Linear is replayed and every Linear inside the submodule quantized."""
    return linear in replayed and _complete(name, linears, done)


def _replay_returning_modules(
    replays: dict[str, list], returns: dict[str, tuple[str, int]], linears: dict[str, nn.Linear], done: set[str]
) -> None:
    """A submodule that returns its last Linear's output (self_attn returns o_proj's) is
    replayed whole as soon as all its Linears are quantized: no pass recomputes it."""
    for name, (linear, length) in sorted(returns.items(), key=lambda item: len(item[0])):
        if _returns_whole(name, linear, replays, linears, done):
            outputs = [(out,) + (None,) * (length - 1) if length else out for out in replays[linear]]
            _replay_whole(replays, done, name, outputs)


def _stage_pass(run, first: nn.Module, replays, pending, batch, observer, recorded, last_use) -> dict[str, list]:
    """One pass over the batches that observes and records the stage's input, and records
    the outputs of the pending submodules; replays named in last_use are emptied. Batches
    may run side by side (BlockRun.map_batches): what each records is taken batch by batch
    in order on this thread. Where the observer updates on this thread alone (AMX tiles,
    small Hessians) they stream: the other threads go on with the next batches while this
    one updates (every input is kept anyway), where bounded they waited for it
    (alternating runs of the GPTQ job on a 2-core Xeon: bundled model 0.495 -> 0.449 s,
    SmolLM2-shaped 5.48 -> 5.42 s, medians). Where its updates take every thread (wider
    inputs, other CPUs), batches running meanwhile would compete with them for the cores:
    bounded (SmolLM2's down_proj, 1536 features, streamed too: the same time within the
    runs' spread)."""
    outputs: dict[str, list] = {name: [] for name in pending}
    record = threading.local()  # the calling thread's batch: its stage input, pending outputs
    alone = bool(run.inputs) and observer.updates_alone(first.in_features, _hidden_of(*run.inputs[0]).dtype)

    def take_input(_module, args):
        record.input = args[0]
        raise _StopForward

    def one(index: int, args: tuple, kwargs: dict) -> tuple[Tensor | None, dict]:
        batch.begin(index, args, kwargs)
        record.input, record.outputs = None, {}
        run_until_stopped(run.block, *args, **kwargs)
        return record.input, record.outputs

    with _replaying(run.block, replays, batch, last_use):
        handles = [first.register_forward_pre_hook(take_input)]
        handles += [
            run.block.get_submodule(name).register_forward_hook(
                lambda _m, _a, out, name=name: record.outputs.setdefault(name, out)
            )
            for name in pending
        ]
        try:
            for x, outs in run.map_batches(one, waves=None if alone else 1):
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
