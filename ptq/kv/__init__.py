"""Quantized key/value caches: recipes' `kv_cache` entry, calibration, the Cache class, evaluation.

    cache = ptq.kv_cache(model)                     # the scheme the model was quantized / loaded with
    cache = ptq.kv_cache(model, scheme="INT4")      # kivi, no calibration needed
    model.generate(input_ids, cache=cache, max_new_tokens=64)
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ptq.errors import PtqError
from ptq.kv.cache import ATTENTION, QuantizedKVCache, QuantizedKVLayer, dense_bytes_per_token
from ptq.kv.calibrate import KVState, attention_shape, calibrate_kv, check_kv_model
from ptq.kv.scheme import KVCacheScheme

__all__ = [
    "ATTENTION", "KVCacheScheme", "KVState", "QuantizedKVCache", "QuantizedKVLayer", "attention_shape",
    "calibrate_kv", "check_kv_model", "dense_bytes_per_token", "kv_cache", "parse_scheme", "use_kv_cache",
]


def parse_scheme(scheme: Any) -> KVCacheScheme:
    """A KVCacheScheme from itself, a recipe-style dict, or a name (INT4 / INT2: kivi defaults)."""
    from pydantic import ValidationError

    if isinstance(scheme, KVCacheScheme):
        return scheme
    if isinstance(scheme, str):
        scheme = {"scheme": scheme, "strategy": "kivi" if scheme.upper() in ("INT4", "INT2") else "tensor"}
    try:
        return KVCacheScheme.model_validate(scheme)
    except ValidationError as error:
        first = error.errors()[0]
        raise PtqError(f"kv_cache scheme {scheme!r}: {first['msg'].removeprefix('Value error, ')}") from None


def kv_cache(model: nn.Module, scheme: Any = None, *, fused: bool | None = None) -> QuantizedKVCache:
    """A quantized cache for `model`: the scheme it was quantized or loaded with (model.ptq_kv)
    or `scheme`. Static schemes (FP8 / INT8, tensor / head) take the model's calibrated
    scales; kivi needs none. fused: read the bytes with the Triton decode kernel (default:
    when the model's attention is ptq's (use_kv_cache) and it runs on CUDA)."""
    state: KVState | None = getattr(model, "ptq_kv", None)
    spec = parse_scheme(scheme) if scheme is not None else (state.spec if state else None)
    if spec is None:
        raise PtqError("the model has no kv_cache scheme; pass scheme= (e.g. 'INT4') or quantize with a kv_cache recipe")
    check_kv_model(model, spec)
    k_scales = v_scales = None
    if spec.static:
        if state is None or state.spec != spec or state.k_scales is None:
            raise PtqError(f"kv_cache {spec.describe()} needs scales calibrated for this model: run ptq.quantize with "
                           "a recipe whose kv_cache is this scheme, or use strategy kivi (INT4 / INT2)")
        k_scales, v_scales = state.k_scales, state.v_scales
    if fused is None:
        fused = _fused_default(model, spec)
    layers, _, _ = attention_shape(model.config)
    return QuantizedKVCache(spec, layers, k_scales, v_scales, fused=fused)


def _fused_default(model: nn.Module, spec: KVCacheScheme) -> bool:
    """The decode kernel reads the cache on CUDA when the model's attention is ATTENTION,
    for the layouts it knows (not keys per token; kivi groups of 16, 32, ...) and where the
    GPU has them (fp8: sm_89+)."""
    from ptq.modules import triton_installed

    device = next(model.parameters()).device
    if (getattr(model.config, "_attn_implementation", None) != ATTENTION or device.type != "cuda"
            or not triton_installed() or spec.keys == "token"):
        return False
    from ptq.kernels.kv_attention import is_supported

    return is_supported(device, spec.kind, spec.group_size)


def use_kv_cache(model: nn.Module, state: KVState) -> None:
    """Make `model` use its quantized cache by itself: model.ptq_kv = state, generate()
    creates a QuantizedKVCache when no cache is passed, and on CUDA (with triton) the
    attention becomes ATTENTION, which reads the cache's bytes on decoding steps."""
    model.ptq_kv = state
    if next(model.parameters()).device.type == "cuda":
        from ptq.modules import triton_installed

        if triton_installed():
            from ptq.kv.attention import register

            register()
            model.set_attn_implementation(ATTENTION)
    original = model._prepare_cache_for_generation

    def prepare(generation_config, model_kwargs, *args, **kwargs):
        if (model_kwargs.get("cache") is None and generation_config.use_cache is not False
                and generation_config.cache_implementation is None):
            model_kwargs["cache"] = kv_cache(model)
            return None
        return original(generation_config, model_kwargs, *args, **kwargs)

    model._prepare_cache_for_generation = prepare
