"""The layer-by-layer runner: calibration samples go through the model one block at a time.

1. Capture the blocks' inputs: the model runs on each batch with every block replaced by
   a recorder that stores its arguments and passes the hidden states on (the last one ends
   the pass). Block 0's hidden states start the calibration; each block keeps its own
   keyword arguments (masks and rotary tables differ between layer types).
2. For each block: move it to the compute device, let the caller collect statistics from
   its Linears (hooks feed observers) and quantize it, run the samples through the
   (quantized) block to get the next block's inputs, move it back.

Peak accelerator memory is one block plus the activations of the calibration samples.
When those would not fit in the GPU's free memory (activation_device), they wait on the
CPU between uses instead: each batch's hidden states go to the GPU when a pass reads them
and come back when the block has produced them, and so do the true-sequential engine's
recorded stage inputs and replayed outputs (ptq.calibration.sequential): the GPU holds
one batch's at a time (bit-identical results, more transfers).
The runner knows modules and hooks, not algorithms: callers say which Linears to observe
and with which observer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ptq import cpu_mlp, cpu_norm, cpu_rotary
from ptq.calibration.observers import Observer
from ptq.cpu_attention import compiled_attention
from ptq.devices import map_side_by_side
from ptq.modules import cached_weight

Inputs = list[tuple[tuple, dict]]  # per batch: the block's positional and keyword arguments
CPU_BATCH_TOKENS = 2048  # calibration tokens a block's pass takes at once on a CPU, about (batch_size_for)
ACCELERATOR_BATCH_TOKENS = 4096  # and on an accelerator
MIN_BATCHES = 4  # at least, where there are enough samples: batches run side by side on a CPU's cores
T = TypeVar("T")
S = TypeVar("S")


def batch_size_for(samples: int, seq_len: int, device: torch.device | str) -> int:
    """Calibration samples that run through a block together: about CPU_BATCH_TOKENS tokens
    on a CPU (ACCELERATOR_BATCH_TOKENS elsewhere), at least one sample, and at most a
    MIN_BATCHES-th of the samples. It depends on nothing else (not on the thread count),
    so that every process of a multi-process run and a resumed run batch alike.

    Fewer, longer passes pay transformers' per-op costs (a few dozen small ops per block
    and batch) less often: on SmolLM2's shapes (30 blocks, 576 features) GPTQ on 32 x 256
    tokens quantized in 9.3 s with 8 samples a batch, 9.8 s with 4 and 10.4 s with 2 (the
    earlier fixed size; runs alternated), at 80-120 MB more peak RSS; at 512-token samples
    2 and 4 a batch took about the same time."""
    tokens = CPU_BATCH_TOKENS if torch.device(device).type == "cpu" else ACCELERATOR_BATCH_TOKENS
    return max(1, min(tokens // seq_len, samples // MIN_BATCHES))


class BlockWeights(Protocol):
    """Where the blocks' weights come from and go to when the model is streamed from disk
    (ptq.streaming.StreamedWeights); an in-memory model has its weights already present."""

    def capturing(self) -> None:
        """Bring into memory what capturing the blocks' inputs runs (the embeddings)."""

    def captured(self) -> None:
        """The blocks' inputs are captured: what only that needed can go."""

    def load(self, name: str) -> None:
        """Bring the weights of module `name` (a block) into memory."""

    def done(self, name: str) -> None:
        """Module `name` is finished: store it and free its weights."""


class _StopForward(Exception):
    """Raised by a pre-hook to end a forward pass once the wanted inputs are captured."""


def run_until_stopped(module: nn.Module, *args, **kwargs) -> None:
    """Call module; a hook that raised _StopForward ends the call early, as intended."""
    try:
        module(*args, **kwargs)
    except _StopForward:
        pass


class StandIn(nn.Module):
    """Takes a block's place in the model's loop for a pass; attributes the loop reads from
    a block (Gemma 3's attention_type) come from the block it stands in for."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)


class _Recorder(StandIn):
    """Stands in for a block while its arguments are captured: records them and passes the
    hidden states through (the last one ends the pass)."""

    def __init__(self, block: nn.Module, calls: list, first: bool, last: bool, store: torch.device):
        super().__init__(block)
        self.calls, self.first, self.last, self.store = calls, first, last, store

    def forward(self, *args, **kwargs):
        hidden = _hidden_of(args, kwargs)
        if self.first:  # block 0's inputs start the calibration: kept where activations wait
            self.calls.append(_with_hidden(args, kwargs, hidden.to(self.store)))
        else:  # only the keyword arguments of the other blocks are kept
            self.calls.append(((), {k: v for k, v in kwargs.items() if v is not hidden}))
        if self.last:
            raise _StopForward
        return hidden


@torch.no_grad()
def capture_block_inputs(
    model: nn.Module, blocks: nn.ModuleList, batches: Tensor, device: torch.device, batch_size: int,
    store: torch.device | None = None,
) -> tuple[Inputs, list[list[dict]]]:
    """For each batch of token ids [samples, seq_len]: the arguments block 0 receives (its
    hidden states on `store`, the compute device by default), and the keyword arguments
    every block receives ([batch][block]). They differ between blocks where layer types
    differ (Gemma 3's sliding and full attention: masks, rotary tables)."""
    calls: list[list] = [[] for _ in blocks]
    originals = list(blocks)
    for i, block in enumerate(originals):
        blocks[i] = _Recorder(block, calls[i], first=i == 0, last=i == len(originals) - 1, store=store or device)
    try:
        _move_all_but_blocks(model, nn.ModuleList(originals), device)
        for batch in batches.split(batch_size):
            run_until_stopped(model, input_ids=batch.to(device), use_cache=False)
    finally:
        for i, block in enumerate(originals):
            blocks[i] = block
    first = calls[0]
    per_block = [[calls[i][b][1] for i in range(len(originals))] for b in range(len(first))]
    return first, per_block


def _move_all_but_blocks(model: nn.Module, blocks: nn.ModuleList, device: torch.device) -> None:
    """Move every parameter and buffer outside the block stack to device; those on the
    meta device (a streamed model's, not loaded) stay there."""
    block_tensors = {id(t) for t in list(blocks.parameters()) + list(blocks.buffers())}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in block_tensors and param.device != device and not param.is_meta:
                param.data = param.data.to(device)
        for name, buf in list(module.named_buffers(recurse=False)):
            if id(buf) not in block_tensors and buf.device != device and not buf.is_meta:
                module._buffers[name] = buf.to(device)


def _hidden(output) -> Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(args: tuple, kwargs: dict, hidden: Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


ACTIVATION_SHARE = 0.8  # of the GPU memory free beside two blocks, that activations may take


def activation_device(model: nn.Module, blocks: nn.ModuleList, tokens: int, device: torch.device) -> torch.device:
    """Where the calibration activations wait between passes: on the compute device, or on
    the CPU when they would not fit on the GPU. Counted per token: a block's inputs, its
    outputs and its attention's output (hidden each), and at the MLP two intermediate-wide
    tensors (the recorded input of down_proj beside the gate/up outputs it replaces)."""
    if device.type != "cuda":
        return device
    config = getattr(model, "config", None)
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    hidden = getattr(config, "hidden_size", None)
    if not isinstance(hidden, int):
        return device  # nothing to estimate from: as before
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    element = next(blocks.parameters()).element_size()
    needed = tokens * element * (3 * hidden + 2 * intermediate)
    block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    free, _ = torch.cuda.mem_get_info(device)
    return device if needed <= ACTIVATION_SHARE * (free - 2 * block_bytes) else torch.device("cpu")


class OnDevice(Sequence):
    """A block's calibration inputs that wait on the CPU: reading a batch moves its hidden
    states to the compute device (the other arguments are there already)."""

    def __init__(self, inputs: Inputs, device: torch.device):
        self.inputs, self.device = inputs, device

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> tuple[tuple, dict]:
        args, kwargs = self.inputs[i]
        return _with_hidden(args, kwargs, _hidden_of(args, kwargs).to(self.device))


@dataclass
class BlockRun:
    """One block on the compute device with its calibration inputs; `store`: where the
    activations wait between passes (the compute device, or the CPU: see OnDevice)."""

    index: int
    name: str
    block: nn.Module
    inputs: Sequence[tuple[tuple, dict]]
    store: torch.device | None = None

    def keep(self, hidden: Tensor) -> Tensor:
        """hidden states to keep for a later pass, moved to where activations wait."""
        return hidden if self.store is None else hidden.to(self.store)

    @torch.no_grad()
    def collect(
        self,
        linears: dict[str, nn.Linear],
        make_observer: Callable[[], Observer],
        stop_at: nn.Module | None = None,
        hooks: Sequence[tuple[nn.Module, Callable[[tuple, dict], None]]] = (),
        waves: int = 1,
    ) -> dict[str, Observer]:
        """Run every batch through the block and observe the inputs of the given Linears.

        Linears that receive the very same input tensor (q/k/v, gate/up) share one
        observer, so their statistic is computed once. With stop_at, each pass ends when
        that module is about to run (nothing after it is needed). hooks: (module, callback)
        pairs, the callback given the (args, kwargs) of each call of its module (in the
        pairs' order where a module has several). Batches may run side by
        side (map_batches, bounded to `waves` waves ahead): what they observe is recorded,
        and observers and hooks see it batch by batch in order, call by call, on this thread.
        """
        observers: dict[str, Observer] = {}
        record = threading.local()  # each thread's pass records its batch's calls

        def observe(name: str):
            return lambda _module, args: record.calls.append((name, args, None))

        def call(callback: Callable[[tuple, dict], None]):
            return lambda _module, args, kwargs: record.calls.append((callback, args, kwargs))

        def run(_index: int, args: tuple, kwargs: dict) -> list[tuple]:
            record.calls = []
            run_until_stopped(self.block, *args, **kwargs)
            return record.calls

        def replay(calls: list[tuple]) -> None:
            seen: list[tuple[Tensor, Observer]] = []  # this batch's inputs and their observers
            for what, args, kwargs in calls:
                if not isinstance(what, str):
                    what(args, kwargs)
                    continue
                x = args[0]
                shared = next((observer for tensor, observer in seen if tensor is x), None)
                if shared is not None:
                    observers.setdefault(what, shared)
                    continue
                observer = observers.get(what) or make_observer()
                observers[what] = observer
                observer.update(x)
                seen.append((x, observer))

        handles = [m.register_forward_pre_hook(call(c), with_kwargs=True) for m, c in hooks]
        handles += [m.register_forward_pre_hook(observe(n)) for n, m in linears.items()]
        if stop_at is not None:
            handles.append(stop_at.register_forward_pre_hook(_raise_stop))
        try:
            with compiled_glue(self.block) if self.device.type == "cpu" else contextlib.nullcontext():
                for calls in self.map_batches(run, waves=waves):
                    replay(calls)
        finally:
            for handle in handles:
                handle.remove()
        return observers

    @property
    def device(self) -> torch.device:
        """Where the block computes."""
        return next(self.block.parameters()).device

    def map_batches(self, function: Callable[[int, tuple, dict], T], bounded: bool = True,
                    waves: int | None = 1) -> Iterator[T]:
        """function(index, args, kwargs) of every batch, in order.

        On a CPU batches run side by side (devices.side_by_side: up to 8 at once, each on its
        own thread with an equal share of torch's threads), no more of them ahead of the
        result taken next than `waves` times the threads in flight (None: no bound, where
        the caller keeps every result but works on each as it comes), which bounds what
        waits in memory (devices.map_side_by_side, bounded). bounded=False where the caller
        keeps every result anyway (a list): a thread that comes free then always takes the
        next batch. Bounded by one wave, the calling thread ran a batch itself while its next
        result was on another thread, which, done, could not start a batch until the caller
        was back to take that result: SmolLM2-shaped blocks of 4 batches on 2 cores ran in 3
        waves, not 2, about half the time (a plain pass of the 30 blocks 3.4-4.2 s bounded,
        2.7-2.9 s not)."""
        return map_side_by_side(lambda i: function(i, *self.inputs[i]), range(len(self.inputs)), self.device,
                                bounded=bounded, waves=waves)

    def map_items(self, function: Callable[[S], T], items: Sequence[S]) -> list[T]:
        """[function(item) for item in items], side by side on a CPU as map_batches runs
        batches (all results are kept, so all at once): e.g. a quantized Linear's outputs on
        every recorded input, each a GEMM on one thread instead of one GEMM after another,
        each on all threads and joined after every call."""
        return list(map_side_by_side(function, items, self.device))

    @torch.no_grad()
    def first_input(self, module: nn.Module) -> Tensor:
        """What module receives in the first batch's pass through the block (which stops there)."""
        captured: list[Tensor] = []

        def take(_module, args):
            captured.append(args[0])
            raise _StopForward

        handle = module.register_forward_pre_hook(take)
        args, kwargs = self.inputs[0]
        try:
            run_until_stopped(self.block, *args, **kwargs)
        finally:
            handle.remove()
        assert captured, "the module is not called by the block's forward pass"
        return captured[0]

    @torch.no_grad()
    def outputs(self) -> Inputs:
        """The next block's inputs: this block's outputs for every batch."""
        with cached_weight(self.block):
            return list(self.map_batches(
                lambda _i, args, kwargs: _with_hidden(args, kwargs, self.keep(_hidden(self.block(*args, **kwargs)))),
                bounded=False))


@contextmanager
def compiled_glue(block: nn.Module) -> Iterator[None]:
    """On a CPU, the block's Llama-style RMSNorms, MLP products and rotary embeddings compiled
    while inside (ptq.cpu_norm, ptq.cpu_mlp, ptq.cpu_rotary: the same bits as transformers'
    code)."""
    with cpu_norm.compiled_norms(block), cpu_mlp.compiled_products(block), cpu_rotary.compiled_rotary(block):
        yield


def _raise_stop(_module, _args):
    raise _StopForward


@contextmanager
def _onloaded(block: nn.Module, device: torch.device) -> Iterator[None]:
    home = next(block.parameters()).device
    block.to(device)
    try:
        yield
    finally:
        block.to(home)


def run_blocks(
    model: nn.Module,
    blocks_path: str,
    batches: Tensor,
    process: Callable[[BlockRun], Inputs | None],
    *,
    device: torch.device,
    batch_size: int | None = None,
    propagate: str = "quantized",
    show_progress: bool = True,
    start: int = 0,
    start_hidden: list[Tensor] | None = None,
    block_done: Callable[[int, nn.Module, list[Tensor]], None] | None = None,
    weights: BlockWeights | None = None,
    notes: list[str] | None = None,
) -> None:
    """Call process(run) for each block in order, feeding it the calibration inputs.

    process may return the block's outputs (when it computed them on the way); otherwise
    they are computed by running the processed block.

    propagate="quantized": each block's inputs are the outputs of the already-processed
    previous block; "original": the outputs the previous block gave before processing.

    batch_size: samples per batch (by default batch_size_for's).

    To resume, `start` skips the blocks already done and `start_hidden` gives block
    `start` its hidden states, one per batch (re-split where they were saved in other
    batches; the other arguments are the same for every block and captured anew).
    block_done(index, block, next hidden states) is called after each block, for a store
    to keep them.

    weights: a model streamed from disk (on the meta device but for what the capture needs):
    each block is loaded before it is processed and handed back after block_done.
    notes: told when the activations wait on the CPU (activation_device).
    """
    blocks = model.get_submodule(blocks_path)
    home = next(blocks.parameters()).device  # where the model lives between uses
    if home.type == "meta":  # streamed: what stays loaded (rotary tables) goes back to the CPU
        home = torch.device("cpu")
    if weights is not None:
        weights.capturing()
    store = activation_device(model, blocks, batches.numel(), device)
    if store != device and notes is not None:
        notes.append(f"the calibration activations of {batches.shape[0]} x {batches.shape[1]} tokens wait on the "
                     f"CPU between passes: they would not fit in the free memory of {device}")
    if batch_size is None:
        batch_size = batch_size_for(batches.shape[0], batches.shape[1], device)
    inputs, block_kwargs = capture_block_inputs(model, blocks, batches, device, batch_size, store=store)
    if weights is not None:
        weights.captured()
    if start_hidden is not None:
        if [len(h) for h in start_hidden] != [len(_hidden_of(*i)) for i in inputs]:  # saved in other batches
            start_hidden = list(torch.cat(start_hidden).split(batch_size))
        assert len(start_hidden) == len(inputs), "saved inputs do not match the calibration batches"
        inputs = [_with_hidden(args, kwargs, h.to(store)) for (args, kwargs), h in zip(inputs, start_hidden)]
    dtype = _hidden_of(*inputs[0]).dtype if inputs else torch.float32  # the passes' compute dtype
    with compiled_attention(model, device, dtype) as attention, \
            tqdm(total=len(blocks), initial=start, desc="blocks", unit="block", disable=not show_progress) as bar:
        for index in range(start, len(blocks)):
            block = blocks[index]
            inputs = [_with_hidden(args, kwargs[index], _hidden_of(args, kw))
                      for (args, kw), kwargs in zip(inputs, block_kwargs)]  # this block's own kwargs
            if weights is not None:
                weights.load(f"{blocks_path}.{index}")
            with _onloaded(block, device):
                run = BlockRun(index, f"{blocks_path}.{index}", block,
                               inputs if store == device else OnDevice(inputs, device), store)
                original_outputs = run.outputs() if propagate == "original" else None
                outputs = process(run)
                if original_outputs is not None:
                    inputs = original_outputs
                else:
                    inputs = outputs if outputs is not None else run.outputs()
                if store != device:  # where process() computed the outputs itself (KV ranges)
                    inputs = [_with_hidden(args, kwargs, run.keep(_hidden_of(args, kwargs))) for args, kwargs in inputs]
            if block_done is not None:
                block_done(index, block, [_hidden_of(args, kwargs) for args, kwargs in inputs])
            if weights is not None:
                weights.done(f"{blocks_path}.{index}")
            bar.update()
    if attention is not None and notes is not None and attention.note():
        notes.append(attention.note())
    _move_all_but_blocks(model, blocks, home)  # embeddings, final norm, head: back home


def _hidden_of(args: tuple, kwargs: dict) -> Tensor:
    return args[0] if args else kwargs["hidden_states"]
