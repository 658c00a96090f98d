"""The quantized KV cache in a checkpoint.

FP8 (static, per tensor or per kv head) is written as compressed-tensors writes it and
vLLM reads it: `kv_cache_scheme` in quantization_config (8-bit float, symmetric, static;
strategy "tensor" or "attn_head") and one `k_scale` / `v_scale` tensor per layer on the
attention module (`model.layers.N.self_attn.k_scale`), shape [1] per tensor or
[kv_heads, 1, 1] per head, in the checkpoint dtype; x = code * scale.

INT8 / INT4 / INT2 have no compressed-tensors or vLLM form: their settings (and INT8's
scales, one per layer and kv head) go to kv_cache.json, which ptq.load reads to rebuild
the same cache; transformers and vLLM load the weights and use their own cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from compressed_tensors.quantization import QuantizationArgs
from pydantic import ValidationError
from torch import Tensor, nn

from ptq.arch import find_blocks
from ptq.errors import PtqError
from ptq.kv.calibrate import KVState, attention_shape
from ptq.kv.scheme import KVCacheScheme
from ptq.schemes import ct_value

KV_FILE = "kv_cache.json"
SCALE_NAMES = ("k_scale", "v_scale")


def attention_names(model: nn.Module) -> list[str]:
    """The attention module of each decoder layer (the module with layer_idx), in order."""
    blocks_path, blocks = find_blocks(model)
    names = []
    for index, block in enumerate(blocks):
        found = [n for n, m in block.named_modules() if n and hasattr(m, "layer_idx")]
        names.append(f"{blocks_path}.{index}.{found[0]}")
    return names


def in_compressed_tensors(spec: KVCacheScheme) -> bool:
    return spec.scheme == "FP8"


def kv_cache_scheme(spec: KVCacheScheme) -> QuantizationArgs:
    """compressed-tensors' kv_cache_scheme for an FP8 cache."""
    return QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False,
                            strategy="tensor" if spec.strategy == "tensor" else "attn_head")


def scale_tensors(model: nn.Module, state: KVState, dtype: torch.dtype) -> dict[str, Tensor]:
    """FP8's k_scale / v_scale tensors, named and shaped as compressed-tensors stores them."""
    tensors = {}
    per_head = state.spec.strategy == "head"
    for name, k, v in zip(attention_names(model), state.k_scales, state.v_scales):
        for what, scale in zip(SCALE_NAMES, (k, v)):
            tensors[f"{name}.{what}"] = (scale.reshape(-1, 1, 1) if per_head else scale[:1]).to(dtype).contiguous()
    return tensors


def write_kv_file(folder: Path, state: KVState) -> None:
    data = {"kv_cache": state.spec.model_dump(mode="json", exclude_none=True)}
    if state.spec.static:
        data["k_scale"] = [s.tolist() for s in state.k_scales]
        data["v_scale"] = [s.tolist() for s in state.v_scales]
    (folder / KV_FILE).write_text(json.dumps(data, indent=2) + "\n")


def read_kv_state(folder: Path, qconfig: dict | None, tensors: dict[str, Tensor], model: nn.Module) -> KVState | None:
    """The checkpoint's KV cache settings (and scales), checked; the scale tensors are
    removed from `tensors`. None when the checkpoint has no quantized cache."""
    scheme = (qconfig or {}).get("kv_cache_scheme")
    layers, heads, _ = attention_shape(model.config)
    if scheme is not None:
        spec = _fp8_spec(scheme)
        k_scales, v_scales = [], []
        for name in attention_names(model):
            for what, scales in zip(SCALE_NAMES, (k_scales, v_scales)):
                scales.append(_scale(tensors.pop(f"{name}.{what}", None), f"{name}.{what}", spec, heads))
        return KVState(spec, k_scales, v_scales)
    path = folder / KV_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        spec = KVCacheScheme.model_validate(data["kv_cache"])
    except (OSError, ValueError, KeyError, TypeError, ValidationError) as error:
        raise PtqError(f"{KV_FILE} is not a ptq KV cache description ({str(error).splitlines()[0]}); "
                       "re-create the checkpoint") from None
    if not spec.static:
        return KVState(spec)
    scales = []
    for key in ("k_scale", "v_scale"):
        values = data.get(key)
        try:
            tensor = torch.tensor(values, dtype=torch.float32)
        except (TypeError, ValueError):
            tensor = None
        if tensor is None or tensor.shape != (layers, heads) or not (torch.isfinite(tensor).all() and (tensor > 0).all()):
            raise PtqError(f"{KV_FILE} {key} must be {layers} layers x {heads} kv heads of positive numbers")
        scales.append(list(tensor))
    return KVState(spec, *scales)


def _fp8_spec(scheme: object) -> KVCacheScheme:
    try:
        args = QuantizationArgs.model_validate(scheme)
    except (ValidationError, ValueError, TypeError) as error:
        raise PtqError(f"quantization_config kv_cache_scheme is not compressed-tensors' ({str(error).splitlines()[0]})") from None
    strategy = {"tensor": "tensor", "attn_head": "head"}.get(str(ct_value(args.strategy)))
    if ct_value(args.type) != "float" or args.num_bits != 8 or args.dynamic or not args.symmetric or strategy is None:
        raise PtqError("quantization_config kv_cache_scheme: ptq runs static, symmetric 8-bit float caches per tensor "
                       "or per attention head")
    return KVCacheScheme(scheme="FP8", strategy=strategy)


def _scale(tensor: Tensor | None, name: str, spec: KVCacheScheme, heads: int) -> Tensor:
    if tensor is None:
        raise PtqError(f"has a kv_cache_scheme but no tensor '{name}'")
    want = (heads, 1, 1) if spec.strategy == "head" else (1,)
    if tuple(tensor.shape) != want or not tensor.is_floating_point():
        raise PtqError(f"tensor '{name}' is {tensor.dtype} {list(tensor.shape)}; the kv_cache_scheme implies a float {list(want)}")
    scale = tensor.float().reshape(-1)
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise PtqError(f"tensor '{name}' holds a scale that is not a positive number; the checkpoint is broken")
    return scale.expand(heads).clone()
