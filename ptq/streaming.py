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
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ptq import moe
from ptq.arch import find_blocks
from ptq.checkpoint.shards import ShardWriter
from ptq.checkpoint.writer import DEFAULT_SHARD_BYTES, checkpoint_tensors
from ptq.errors import PtqError
from ptq.recipe import Recipe, load_recipe
from ptq.safetensors_check import weight_files



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

    def __init__(self, model: nn.Module, folder: Path, shards: ShardWriter, checkpoint_dtype: torch.dtype):
        self.model, self.shards, self.dtype = model, shards, checkpoint_dtype
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
        """Read module `name`'s parameters from the files (one file open at a time)."""
        module = self.model.get_submodule(name)
        wanted: dict[Path, list[nn.Parameter]] = {}
        for param in {id(p): p for p in module.parameters()}.values():
            if param.is_meta:
                stored = self._stored_name(param)
                wanted.setdefault(self.files[stored], []).append(param)
        for path, params in wanted.items():
            with safe_open(path, framework="pt") as f:
                for param in params:
                    self._assign(param, f.get_tensor(self._stored_name(param)))

    def _stored_name(self, param: nn.Parameter) -> str:
        names = [name for _, _, name in self.owners[id(param)]]
        stored = [name for name in names if name in self.files]
        if not stored:
            raise PtqError(f"tensor '{names[0]}' is not in the model's safetensors files; streaming reads models "
                           "whose tensor names are the ones transformers gives their modules (load it in memory)")
        return stored[0]

    @torch.no_grad()
    def _assign(self, param: nn.Parameter, tensor: torch.Tensor) -> None:
        name = self.owners[id(param)][0][2]
        if tensor.shape != param.shape:
            raise PtqError(f"tensor '{name}' has shape {list(tensor.shape)} in the safetensors files; the config "
                           f"implies {list(param.shape)}")
        if tensor.is_floating_point() and not torch.isfinite(torch.stack(tensor.aminmax())).all():
            raise PtqError(f"model weight '{name}' contains NaN or Inf; the source model is broken")
        loaded = nn.Parameter(tensor.to(param.dtype), requires_grad=param.requires_grad)
        self._replace(param, loaded)

    def _replace(self, old: nn.Parameter, new: nn.Parameter) -> None:
        owners = self.owners.pop(id(old))
        self.owners[id(new)] = owners
        for module, attribute, _ in owners:
            module._parameters[attribute] = new

    def done(self, name: str) -> None:
        """Write module `name`'s checkpoint tensors and put its parameters back on the meta device."""
        self.shards.add(moe.checkpoint_tensors(self.model, checkpoint_tensors(self.model, self.dtype, under=name)))
        self.written.add(name)
        for sub in self.model.get_submodule(name).modules():
            for key, param in list(sub._parameters.items()):
                if param is None or param.is_meta:
                    continue
                empty = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                if self._owned(param):  # the model's own: tied places follow
                    self._replace(param, empty)
                else:  # a parameter of a module ptq put in (a QuantLinear's bias)
                    sub._parameters[key] = empty
            for key, buffer in sub._buffers.items():  # QuantLinears' packed weights and scales
                if buffer is not None and key not in sub._non_persistent_buffers_set:
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
