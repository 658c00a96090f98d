"""GPTQ and AWQ checkpoint folders: writing them, and `ptq convert` between the formats.

A GPTQ or AWQ folder holds what a compressed-tensors one does (ptq.checkpoint.writer):
config.json with the format's quantization_config (ptq.export.formats), generation_config.json,
the weights as safetensors (each quantized Linear's tensors in the format's layout, the rest
in the checkpoint dtype), the tokenizer, recipe.yaml when ptq quantized the model, and the
manifest ptq.json (with "format"). It is written through the same atomic work folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from ptq.checkpoint.output import check_output, claim_output, write_manifest
from ptq.checkpoint.writer import (
    DEFAULT_SHARD_BYTES,
    checkpoint_tensors,
    run_settings,
    write_generation_config,
    write_weights,
)
from ptq.errors import PtqError
from ptq.export.card import CardFacts, write_model_card
from ptq.export.formats import COMPRESSED_TENSORS, check_format, export
from ptq.modules import QuantLinear
from ptq.safetensors_check import shorten


def write_checkpoint(
    model: nn.Module, folder: Path, fmt: str, *, tokenizer=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    exported: tuple[dict, dict] | None = None, card: CardFacts | None = None,
) -> None:
    """Write the model as a `fmt` ("gptq" or "awq") checkpoint into the (empty) folder, its
    model card (README.md) and its manifest last. exported: what formats.export(model, fmt)
    returned, when already computed; card: what the run knows for the card."""
    qconfig, quantized = exported or export(model, fmt)
    report = getattr(model, "ptq_report", None)
    dtype = report.checkpoint_dtype if report else model.config.dtype
    config = model.config.to_dict()
    config["quantization_config"] = qconfig
    config["dtype"] = str(dtype).removeprefix("torch.")
    config["architectures"] = [type(model).__name__]
    config.pop("torch_dtype", None)
    buffers = {f"{n}.{b}" for n, m in model.named_modules() if isinstance(m, QuantLinear) for b, _ in m.named_buffers()}
    tensors = {k: t for k, t in checkpoint_tensors(model, dtype).items() if k not in buffers}
    tensors.update(quantized)
    try:
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_generation_config(model, folder)
        write_weights(folder, tensors, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if report is not None:
            (folder / "recipe.yaml").write_text(report.recipe.to_yaml())
        write_model_card(model, folder, dataclasses.replace(card or CardFacts(), format=fmt))
        write_manifest(folder, {**run_settings(report), "format": fmt})
    except OSError as error:
        raise PtqError(f"writing the checkpoint failed: {error.strerror or error}; check the free space") from None
    except SafetensorError as error:
        reason = str(error).split("I/O error: ")[-1]
        raise PtqError(f"writing the checkpoint failed: {reason}; check the free space") from None


def save_as(model: nn.Module, target: Path, fmt: str, *, tokenizer=None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """ptq.save for "gptq" and "awq" (the output folder already checked): every refusal comes
    before any file is written."""
    exported = export(model, fmt)
    with claim_output(target) as slot:
        write_checkpoint(model, slot.new_staging(), fmt, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes,
                         exported=exported, card=CardFacts(name=target.name))
        slot.publish()
    return target.resolve()


def _source_folder(source: str | os.PathLike) -> Path:
    """A local checkpoint folder, or a Hub name downloaded with huggingface_hub (its cache)."""
    path = Path(source).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise PtqError(f"source '{shorten(str(source))}' is not a checkpoint folder (it has no config.json)")
        return path
    name = str(source)
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", name):
        raise PtqError(f"source '{shorten(name)}' does not exist; give a checkpoint folder or a Hub name like org/model")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as error:  # the Hub client raises many kinds (offline, missing repo, auth)
        raise PtqError(f"cannot download '{shorten(name)}' from the Hub ({shorten(str(error).splitlines()[0])})") from None


def _stored_dtype(folder: Path) -> torch.dtype | None:
    try:
        raw = json.loads((folder / "config.json").read_text())
        name = str(raw.get("dtype") or raw.get("torch_dtype") or "").removeprefix("torch.")
    except (OSError, ValueError, AttributeError):
        return None  # ptq.load names the problem
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def convert(
    source: str | os.PathLike, target: str | os.PathLike, *, format: str = COMPRESSED_TENSORS, overwrite: bool = False
) -> Path:
    """Rewrite a quantized checkpoint (compressed-tensors, GPTQ or AWQ; a folder or a Hub name)
    as `format` into `target`, integers bit-exact, with its tokenizer and generation config.
    The output folder follows ptq.save's rules (new, or a ptq checkpoint with overwrite)."""
    import ptq
    from ptq.models import check_tokenizer_files, is_quantized_checkpoint, load_tokenizer

    fmt = check_format(format)
    folder = _source_folder(source)
    target = Path(target)
    check_output(target, overwrite=overwrite, sources=[folder.resolve()])
    if not is_quantized_checkpoint(str(folder)):
        raise PtqError(f"source '{shorten(str(source))}' has no quantization_config; ptq convert rewrites quantized "
                       "checkpoints (compressed-tensors, gptq, awq): quantize a model with ptq quantize")
    model = ptq.load(folder, dtype=_stored_dtype(folder), backend="torch")
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    tokenizer = None
    if any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        check_tokenizer_files(folder, str(source))
        tokenizer = load_tokenizer(str(folder))
    return ptq.save(model, target, tokenizer=tokenizer, overwrite=overwrite, format=fmt)
