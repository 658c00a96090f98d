"""Quantize a model folder of safetensors without holding the model in memory.

The model is built on the meta device from config.json (accelerate's init_empty_weights:
buffers such as rotary tables are computed as usual). ptq.quantize then runs on it as on
an in-memory model, with a StreamedWeights that it hands the modules to: each block's
weights are read from the safetensors files (safe_open, memory-mapped, closed again)
just before the block is calibrated and quantized, its tensors are written to the output
shards (ptq.checkpoint.shards.ShardWriter, tensor by tensor) right after, and it goes back to the meta
device. The embeddings are loaded to capture the blocks' inputs and written then; what
no step touches (the final norm, an ignored lm_head) is copied through one module at a
time at the end. The calibration activations stay in memory.

The checkpoint holds the same tensors as the in-memory path's (names, dtypes, bytes) and
the same config.json; only its split into shard files differs.

streamed_logits evaluates such a model the same way: evaluation windows go through the
blocks one block at a time, each read from the source folder (the original) or from the
checkpoint just written (the quantized model: QuantLinears' tensors as stored), and give
the logits the model in memory gives, bit for bit (`ptq quantize --stream` without
--no-eval).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from ptq import moe
from ptq.arch import find_blocks
from ptq.calibration.runner import StandIn, _hidden_of
from ptq.evaluate import EVAL_BATCH_SIZE
from ptq.checkpoint.shards import ShardWriter
from ptq.checkpoint.writer import DEFAULT_SHARD_BYTES, checkpoint_tensors
from ptq.errors import PtqError
from ptq.recipe import Recipe, load_recipe
from ptq.safetensors_check import weight_files



MMAP_THRESHOLD = 1 << 20  # bytes: glibc serves larger blocks with their own mapping
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def return_freed_memory() -> None:
    """Have glibc's malloc give every freed block of MMAP_THRESHOLD or more straight back
    to the OS, as MALLOC_MMAP_THRESHOLD_=1048576 would (a user's setting of it is kept).
    By default glibc raises that threshold up to 32 MB as large blocks are freed, so that
    the blocks a streamed run allocates and frees over and over (a block's weights, 127 MB
    Hessians, activations) come from its heap and stay resident there: a 3-block Llama of
    TinyLlama's width peaked at 1,399 MiB streamed with GPTQ, 1,158 MiB with the fixed
    threshold. Results do not change; allocation of large blocks costs a page fault more."""
    import ctypes
    import platform

    if "MALLOC_MMAP_THRESHOLD_" in os.environ or platform.libc_ver()[0] != "glibc":
        return
    ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def meta_model(folder: Path) -> nn.Module:
    """The causal LM of folder's config.json, its parameters on the meta device, in the
    dtype it was saved in, with its generation_config.json when there is one."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    model.tie_weights()  # init_empty_weights gives a tied weight its own meta Parameter: tie them again
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


class StreamedWeights:
    """Loads a meta-device model's modules from safetensors files and, once done, writes
    their checkpoint tensors to a ShardWriter and frees them (ptq.calibration.runner.BlockWeights).

    Tensors are loaded in the dtype the model's parameter has (ptq.quantize casts the meta
    model to the compute dtype first), so that the module is the one an in-memory model
    would hold; tied parameters are loaded once and stay tied."""

    def __init__(self, model: nn.Module, folder: Path, shards: ShardWriter | None = None,
                 checkpoint_dtype: torch.dtype | None = None):
        self.model, self.folder, self.shards, self.dtype = model, folder, shards, checkpoint_dtype
        self.blocks_path, _ = find_blocks(model)
        self.files: dict[str, Path] = {}  # tensor name -> the file holding it
        for path in weight_files(folder):
            with safe_open(path, framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), path))
        # id(param) -> (module, attribute, full name) of every place holding it (tied weights: several)
        self.owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            module_name, _, attribute = name.rpartition(".")
            self.owners.setdefault(id(param), []).append((model.get_submodule(module_name), attribute, name))
        self.written: set[str] = set()
        self.front: list[str] = []  # modules before the blocks, loaded for the capture

    def load(self, name: str) -> None:
        """Read module `name`'s parameters from the files (one file open at a time), and its
        persistent buffers on the meta device (a quantized checkpoint's: QuantLinears') as stored."""
        module = self.model.get_submodule(name)
        wanted: dict[Path, list[nn.Parameter | tuple[nn.Module, str, str]]] = {}
        for param in {id(p): p for p in module.parameters()}.values():
            if param.is_meta:
                stored = self._stored_name(param)
                wanted.setdefault(self.files[stored], []).append(param)
        for sub_name, sub in module.named_modules(prefix=name):
            for key, buffer in _persistent_buffers(sub):
                if buffer.is_meta:
                    stored = f"{sub_name}.{key}"
                    if stored not in self.files:
                        raise PtqError(f"tensor '{stored}' is not in the safetensors files of '{self.folder}'")
                    wanted.setdefault(self.files[stored], []).append((sub, key, stored))
        for path, entries in wanted.items():
            with safe_open(path, framework="pt") as f:
                for entry in entries:
                    if isinstance(entry, nn.Parameter):
                        self._assign(entry, f.get_tensor(self._stored_name(entry)))
                    else:
                        sub, key, stored = entry
                        sub._buffers[key] = self._checked(stored, f.get_tensor(stored), sub._buffers[key].shape)

    def _stored_name(self, param: nn.Parameter) -> str:
        names = [name for _, _, name in self.owners[id(param)]]
        stored = [name for name in names if name in self.files]
        if not stored:
            raise PtqError(f"tensor '{names[0]}' is not in the model's safetensors files; streaming reads models "
                           "whose tensor names are the ones transformers gives their modules (load it in memory)")
        return stored[0]

    @torch.no_grad()
    def _assign(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        tensor = self._checked(self.owners[id(param)][0][2], tensor, param.shape)
        loaded = nn.Parameter(tensor.to(param.dtype), requires_grad=param.requires_grad)
        self._replace(param, loaded)

    def _checked(self, name: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if tensor.shape != shape:
            raise PtqError(f"tensor '{name}' has shape {list(tensor.shape)} in the safetensors files; the config "
                           f"implies {list(shape)}")
        if tensor.is_floating_point() and tensor.numel() and not torch.isfinite(torch.stack(tensor.aminmax())).all():
            raise PtqError(f"model weight '{name}' contains NaN or Inf; the source model is broken")
        return tensor

    def _replace(self, old: nn.Parameter, new: nn.Parameter) -> None:
        owners = self.owners.pop(id(old))
        self.owners[id(new)] = owners
        for module, attribute, _ in owners:
            module._parameters[attribute] = new

    def done(self, name: str) -> None:
        """Write module `name`'s checkpoint tensors and put its parameters back on the meta device."""
        self.shards.add(moe.checkpoint_tensors(self.model, checkpoint_tensors(self.model, self.dtype, under=name)))
        self.written.add(name)
        self.free(name)

    def free(self, name: str) -> None:
        """Put module `name`'s parameters and persistent buffers back on the meta device."""
        for sub in self.model.get_submodule(name).modules():
            for key, param in list(sub._parameters.items()):
                if param is None or param.is_meta:
                    continue
                empty = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                if self._owned(param):  # the model's own: tied places follow
                    self._replace(param, empty)
                else:  # a parameter of a module ptq put in (a QuantLinear's bias)
                    sub._parameters[key] = empty
            for key, buffer in _persistent_buffers(sub):  # QuantLinears' packed weights and scales
                sub._buffers[key] = buffer.to("meta")

    def _owned(self, param: nn.Parameter) -> bool:
        """Whether param is one of the model's parameters (not an id reused by another object)."""
        owners = self.owners.get(id(param))
        return owners is not None and owners[0][0]._parameters.get(owners[0][1]) is param

    def capturing(self) -> None:
        """Load the modules with parameters that come before the blocks (the embeddings)."""
        for name, module in self.model.named_modules():
            if name == self.blocks_path:
                break
            if name and any(True for _ in module.parameters(recurse=False)):
                self.front.append(name)
                self.load(name)

    def captured(self) -> None:
        for name in self.front:
            self.done(name)

    def finish(self) -> None:
        """Copy through the modules no step loaded (the final norm, an ignored lm_head), one
        at a time, so that every stored tensor is written. A module whose parameters are
        all tied to an earlier one's (lm_head tied to the embeddings) stores nothing."""
        for name, module in self.model.named_modules():
            if not name or self._within_written(name) or name.startswith(self.blocks_path + "."):
                continue
            own = [p for key, p in module.named_parameters(prefix=name, recurse=False)
                   if self._owned(p) and self.owners[id(p)][0][2] == key]
            if any(p.is_meta for p in own):
                self.load(name)
                self.done(name)

    def _within_written(self, name: str) -> bool:
        return any(name == w or name.startswith(w + ".") for w in self.written)


def quantize_streamed(
    folder: str | os.PathLike,
    recipe: Recipe | str,
    staging: Path,
    *,
    tokenizer=None,
    data=None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    show_progress: bool = True,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    model: nn.Module | None = None,
) -> tuple[nn.Module, ShardWriter]:
    """ptq.quantize on the model in `folder` (safetensors), streamed: its weights are read
    one block at a time and the checkpoint's tensors written into `staging` as they are
    done. Returns the quantized model, all on the meta device but for its QuantLinears'
    settings and its ptq_report, and the ShardWriter to give write_checkpoint(shards=...).
    model: meta_model(folder), when the caller built it first (to size it)."""
    from ptq.pipeline import quantize

    folder = Path(folder)
    recipe = load_recipe(recipe)
    return_freed_memory()
    if recipe.kv_cache is not None:
        raise PtqError("streaming quantizes weights; a recipe with kv_cache needs the model in memory (drop --stream)")
    model = meta_model(folder) if model is None else model
    if next(moe.experts_modules(model), None) is not None:
        raise PtqError("streaming does not handle MoE models yet; quantize them without --stream")
    shards = ShardWriter(staging, max_shard_bytes)
    weights = StreamedWeights(model, folder, shards, _checkpoint_dtype(model))
    quantize(model, recipe, tokenizer=tokenizer, data=data, device=device, dtype=dtype,
             show_progress=show_progress, weights=weights)
    weights.finish()
    return model, shards


def _checkpoint_dtype(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


class _HandOver(StandIn):
    """Stands in for a block while the head computes the logits (streamed_logits): passes
    the hidden states through, or returns `output`, the last block's (already computed)."""

    def __init__(self, block: nn.Module, output: torch.Tensor | None):
        super().__init__(block)
        self.output = output

    def forward(self, *args, **kwargs):
        if self.output is not None:
            return self.output
        return _hidden_of(args, kwargs)


def _outside_blocks(model: nn.Module, blocks_path: str) -> list[str]:
    """The modules outside the block stack that hold parameters or persistent buffers."""
    names = []
    for name, module in model.named_modules():
        if not name or name == blocks_path or name.startswith(blocks_path + "."):
            continue
        if _persistent_buffers(module) or any(True for _ in module.parameters(recurse=False)):
            names.append(name)
    return names


def _persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of the module's own buffers that a state dict stores."""
    return [(key, buffer) for key, buffer in module._buffers.items()
            if buffer is not None and key not in module._non_persistent_buffers_set]


@torch.no_grad()
def streamed_logits(
    model: nn.Module,
    folder: str | os.PathLike,
    windows: torch.Tensor,
    *,
    batch_size: int = EVAL_BATCH_SIZE,
    device: torch.device | str = "cpu",
    whose: str = "the model's",
    show_progress: bool = False,
) -> Iterator[torch.Tensor]:
    """The logits [b, seq, vocab] of `model` (on the meta device, its weights in the
    safetensors files in `folder`: the source model, or the checkpoint just written) on
    windows.split(batch_size), batch by batch, on the CPU: those model(input_ids=batch)
    gives, bit for bit, without the model in memory.

    The windows go through the blocks one block at a time (each loaded, run on every batch,
    freed), each batch with the arguments the model gives its blocks (captured as the
    calibration captures them); then, for each batch, the model runs again with its blocks
    replaced by stand-ins that hand over the last block's output, so that its own code
    (final norm, head, any scaling) makes the logits. In memory: the modules outside the
    blocks, one block, the hidden states of all windows and one batch's logits."""
    from ptq.calibration.runner import _hidden, _with_hidden, capture_block_inputs
    from ptq.evaluate import checked_logits

    device = torch.device(device)
    return_freed_memory()
    weights = StreamedWeights(model, Path(folder))
    blocks = model.get_submodule(weights.blocks_path)
    outside = _outside_blocks(model, weights.blocks_path)
    for name in outside:
        weights.load(name)
    try:
        inputs, per_block = capture_block_inputs(model, blocks, windows, device, batch_size)
        hidden = [_hidden_of(args, kwargs) for args, kwargs in inputs]
        inputs = [_with_hidden(args, kwargs, None) for args, kwargs in inputs]  # [batch]: the rest of block 0's
        for index in tqdm(range(len(blocks)), desc="evaluate", unit="block", disable=not show_progress):
            name = f"{weights.blocks_path}.{index}"
            weights.load(name)
            block = blocks[index].to(device)
            for b, (args, _) in enumerate(inputs):
                args, kwargs = _with_hidden(args, per_block[b][index], hidden[b])
                hidden[b] = _hidden(block(*args, **kwargs))
            weights.free(name)
        originals = list(blocks)
        for b, batch in enumerate(windows.split(batch_size)):
            for i, block in enumerate(originals):
                blocks[i] = _HandOver(block, hidden[b] if i == len(originals) - 1 else None)
            hidden[b] = None
            try:
                logits = model(input_ids=batch.to(device), use_cache=False).logits.cpu()
            finally:
                for i, block in enumerate(originals):
                    blocks[i] = block
            yield checked_logits(logits, b * batch_size, whose)
            del logits
    finally:
        for name in outside:
            weights.free(name)


def streamed_reference_logits(source: str | os.PathLike, windows: torch.Tensor, folder: Path,
                              compute_dtype: torch.dtype, *, device: torch.device | str = "cpu"):
    """The unquantized model's logits on windows, computed in compute_dtype as ptq.quantize
    will compute, streamed from `source`, kept in `folder` (ptq.evaluate.ReferenceLogits,
    batches of 4 as ptq.evaluate takes them): what `ptq quantize` keeps of the original
    before quantizing it in memory, without loading it."""
    import shutil

    from ptq.evaluate import store_logits
    from ptq.pipeline import cast_parameters_

    shutil.rmtree(folder, ignore_errors=True)  # left by a run killed before it could remove them
    model = meta_model(Path(source))
    cast_parameters_(model, compute_dtype)
    logits = streamed_logits(model, source, windows, batch_size=EVAL_BATCH_SIZE, device=device,
                             whose="the reference model's")  # the batches store_logits is told of
    return store_logits(logits, windows, folder, EVAL_BATCH_SIZE, getattr(model.config, "vocab_size", None))
