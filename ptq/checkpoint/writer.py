"""Write a quantized model as a compressed-tensors checkpoint, atomically.

The folder holds what save_pretrained writes, config.json (with `quantization_config`, in
compressed-tensors' own classes), generation_config.json, the weights as safetensors
(sharded with model.safetensors.index.json past max_shard_bytes) and the tokenizer, and
recipe.yaml, README.md (the model card, ptq.export.card) and ptq.json (the manifest: the
files written and the settings of the run).
Everything is written into a work folder beside the target and renamed into place at the
end, so a failed save leaves nothing behind (ptq.checkpoint.output).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import compressed_tensors
import torch
from compressed_tensors.base import (
    COMPRESSION_VERSION_NAME,
    QUANTIZATION_METHOD,
    QUANTIZATION_METHOD_NAME,
    SPARSITY_CONFIG_NAME,
    TRANSFORM_CONFIG_NAME,
)
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import Tensor, nn

from ptq import moe
from ptq.checkpoint import kv as kv_format
from ptq.checkpoint.output import check_output, claim_output, local_folder, write_manifest
from ptq.checkpoint.shards import ShardWriter
from ptq.errors import PtqError
from ptq.export.card import CardFacts, write_model_card
from ptq.models import float32_names
from ptq.modules import QuantLinear

DEFAULT_SHARD_BYTES = 5 * 1024**3


def quantization_config(model: nn.Module) -> dict | None:
    """config.json's quantization_config for the QuantLinears in the model and an FP8 KV
    cache (ptq.checkpoint.kv), built from compressed-tensors' own classes and laid out as
    its ModelCompressor writes it (with the installed compressed-tensors' version). None
    for a model whose only quantization is a cache compressed-tensors has no form for."""
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    kv = getattr(model, "ptq_kv", None)
    if not quantized and kv is None:
        raise PtqError("the model has no quantized Linear; run ptq.quantize on it before saving")
    fp8_cache = kv is not None and kv_format.in_compressed_tensors(kv.spec)
    if not quantized and not fp8_cache:
        return None
    groups: dict[tuple, list[str]] = {}
    for name, module in quantized.items():
        key = (module.scheme, getattr(module, "actorder", None), getattr(module, "observer", "minmax"))
        groups.setdefault(key, []).append(name)
    single = len(groups) == 1
    config_groups = {}  # always written, {} for a cache alone (vLLM reads the head counts only then)
    for i, ((scheme, actorder, observer), names) in enumerate(groups.items()):
        targets = ["Linear"] if single else [f"re:^{n.replace('.', '[.]')}$" for n in names]
        config_groups[f"group_{i}"] = scheme.to_ct(targets, actorder, observer)
    formats = {group.format for group in config_groups.values()} or {CompressionFormat.dense.value}
    config = QuantizationConfig(
        config_groups=config_groups,
        format=formats.pop() if len(formats) == 1 else CompressionFormat.mixed_precision.value,
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=[n for n, m in model.named_modules() if isinstance(m, nn.Linear)] if quantized else [],
        kv_cache_scheme=kv_format.kv_cache_scheme(kv.spec) if fp8_cache else None,
    )
    return {
        COMPRESSION_VERSION_NAME: compressed_tensors.__version__,
        QUANTIZATION_METHOD_NAME: QUANTIZATION_METHOD,
        SPARSITY_CONFIG_NAME: {},
        TRANSFORM_CONFIG_NAME: {},
        **config.model_dump(),
        **_transformers_load_settings(model, quantized),
    }


# models whose transformers code reads a Linear's dense `weight` while it loads (Falcon's
# _init_weights), which a packed Linear does not have: their packed checkpoints ask for the
# dequantize path, which gives the same weights (and vLLM ignores the setting)
DENSE_WEIGHT_ON_LOAD = ("FalconForCausalLM",)


def _transformers_load_settings(model: nn.Module, quantized: dict[str, QuantLinear]) -> dict:
    """What transformers' loader must be told to read the checkpoint right.

    Zero points are stored as compressed-tensors writes them and vLLM reads them: int32,
    packed along the output dimension, [ceil(out * bits / 32), groups]. transformers' default
    loader (compressed-tensors 0.18's compress_model on the meta device) sizes that tensor
    unpacked, [out, groups], and refuses the checkpoint (llm-compressor issue 1618); its
    `dequantize` path reads the packed zero points, so asymmetric checkpoints ask for it (a
    loading setting that vLLM ignores). That path drops weight_g_idx: zero points with
    activation-order groups would load wrong, so they are refused.
    """
    asymmetric = [name for name, m in quantized.items() if not m.scheme.weights.symmetric]
    for name in asymmetric:
        if hasattr(quantized[name], "weight_g_idx"):
            raise PtqError(
                f"'{name}' has zero points and activation-order groups (weight_g_idx), which transformers "
                "loads without the group order; quantize with actorder 'static' or symmetric weights"
            )
    packed = any(m.scheme.format == "pack-quantized" for m in quantized.values())
    dense_on_load = packed and type(model).__name__ in DENSE_WEIGHT_ON_LOAD
    return {"dequantize": True} if asymmetric or dense_on_load else {}


def stored_tensors(model: nn.Module, dtype: torch.dtype, under: str | None = None
                   ) -> Iterator[tuple[str, Tensor, torch.dtype]]:
    """(name, tensor, dtype it is stored in) for what a checkpoint holds: quantized buffers
    as they are, other float tensors in dtype. Non-persistent buffers (rotary frequencies)
    are left out, and so is a weight tied to another one (lm_head tied to the embeddings).
    Tensors the model's class keeps in float32 (ptq.models.float32_names) stay float32.
    under: only the tensors of that module (a streamed model: ptq.streaming). Where tensors
    are on the meta device (a streamed model), tied aliases are left out by name."""
    seen = set()
    keep = float32_names(model)
    state = model.state_dict()
    streamed = under is not None or any(t.is_meta for t in state.values())  # meta tensors share data_ptr 0
    if streamed:
        aliases = _tied_aliases(model)
        state = {n: t for n, t in state.items() if n not in aliases and (under is None or n.startswith(under + "."))}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tensor.shape, tensor.dtype)
        if not streamed and key in seen and tensor.numel() > 1:
            continue
        seen.add(key)
        cast = tensor.is_floating_point() and tensor.dtype.itemsize > 1 and not _is_scale(name)
        if name in keep and tensor.dtype == torch.float32:
            cast = False
        yield name, tensor, dtype if cast else tensor.dtype


def checkpoint_tensors(model: nn.Module, dtype: torch.dtype, under: str | None = None) -> dict[str, Tensor]:
    """The tensors to store, on the CPU in their stored dtypes (see stored_tensors)."""
    return {name: t.detach().to(stored).contiguous().cpu() for name, t, stored in stored_tensors(model, dtype, under)}


def _tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that are another name's parameter (tied weights): not stored."""
    every = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return every - {name for name, _ in model.named_parameters()}


def _is_scale(name: str) -> bool:
    return name.endswith(("weight_scale", "input_scale"))


def _shards(tensors: dict[str, Tensor], max_bytes: int) -> list[dict[str, Tensor]]:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_weights(folder: Path, tensors: dict[str, Tensor], max_shard_bytes: int) -> None:
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], folder / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    tokenizer=None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    format: str = "compressed-tensors",
) -> Path:
    """Write the quantized model to `path` (a new folder, or a ptq checkpoint to overwrite)
    and return it. The source model's folder is never written to (see ptq.checkpoint.output).
    format: "compressed-tensors", "gptq" or "awq" (ptq.export.formats says what each holds)."""
    from ptq.export.formats import COMPRESSED_TENSORS, check_format

    target = Path(path)
    check_format(format)
    source = local_folder(getattr(model.config, "_name_or_path", None))
    check_output(target, overwrite=overwrite, sources=[source] if source else [])
    if format != COMPRESSED_TENSORS:
        from ptq.export.checkpoint import save_as

        return save_as(model, target, format, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)
    quantization_config(model)  # raises for a model with nothing quantized, before any file
    with claim_output(target) as slot:
        write_checkpoint(model, slot.new_staging(), tokenizer=tokenizer, max_shard_bytes=max_shard_bytes,
                         card=CardFacts(name=target.resolve().name))
        slot.publish()
    return target.resolve()


def write_checkpoint(model: nn.Module, folder: Path, *, tokenizer=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     card: CardFacts | None = None, shards: ShardWriter | None = None) -> None:
    """Write the checkpoint's files into the (empty) folder; its manifest last. card: what the
    run measured (sizes, evaluation) for the model card, README.md (ptq.export.card).
    shards: the weights were written into folder while the model was quantized (a streamed
    model, ptq.streaming): they are finished, not taken from the model."""
    report = getattr(model, "ptq_report", None)
    dtype = report.checkpoint_dtype if report else model.config.dtype
    config = model.config.to_dict()
    qconfig = quantization_config(model)
    if qconfig is not None:
        config["quantization_config"] = moe.checkpoint_quantization_config(model, qconfig)
    kv = getattr(model, "ptq_kv", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["architectures"] = [type(model).__name__]  # as save_pretrained records it (vLLM reads it)
    config.pop("torch_dtype", None)
    try:
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_generation_config(model, folder)
        if shards is not None:
            assert kv is None, "a streamed model has no quantized KV cache"
            shards.finish()
        else:
            tensors = moe.checkpoint_tensors(model, checkpoint_tensors(model, dtype))
            if kv is not None and kv_format.in_compressed_tensors(kv.spec):
                tensors.update(kv_format.scale_tensors(model, kv, dtype))
            elif kv is not None:
                kv_format.write_kv_file(folder, kv)
            write_weights(folder, tensors, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if report is not None:
            (folder / "recipe.yaml").write_text(report.recipe.to_yaml())
        write_model_card(model, folder, card)
        write_manifest(folder, run_settings(report))
    except OSError as error:
        raise PtqError(f"writing the checkpoint failed: {error.strerror or error}; check the free space") from None
    except SafetensorError as error:  # the weights' writer reports I/O errors (a full disk) this way
        reason = str(error).split("I/O error: ")[-1]
        raise PtqError(f"writing the checkpoint failed: {reason}; check the free space") from None


def write_generation_config(model: nn.Module, folder: Path) -> None:
    """generation_config.json, as save_pretrained writes it for a model that can generate."""
    generation = getattr(model, "generation_config", None)
    if generation is None or not getattr(model, "can_generate", lambda: False)():
        return
    try:
        generation.save_pretrained(folder)
    except ValueError as error:  # transformers refuses to save a generation config it finds invalid
        raise PtqError(
            f"the model's generation_config cannot be saved ({str(error).strip().splitlines()[0]}); "
            "fix model.generation_config, or set it to None to save without one"
        ) from None


def run_settings(report) -> dict:
    """What decides the checkpoint's bits besides the recipe and the data, for the manifest."""
    from ptq import __version__

    settings = {"ptq_version": __version__, "torch_version": torch.__version__}
    if report is not None:
        settings.update(report.settings())
    return settings
