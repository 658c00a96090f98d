"""Which attention layers a quantized cache serves, and their static scales from calibration.

The scales are measured where the cache sees the states: a stand-in cache is passed to
each block as it runs on the calibration samples (ptq.calibration.runner, one block at a
time), and its `update` records max |x| per key/value head of the keys after rotary
embedding and of the values, exactly as the attention hands them to a cache.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ptq.arch import find_blocks
from ptq.calibration.runner import BlockRun, Inputs, run_blocks
from ptq.distributed import all_reduce_
from ptq.errors import PtqError
from ptq.kv import quant
from ptq.kv.scheme import KVCacheScheme

CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")  # what blocks call the cache, by version


@dataclass
class KVState:
    """A model's quantized-cache settings: the scheme and, for static schemes, one float32
    scale per layer and kv head (values representable in the checkpoint dtype)."""

    spec: KVCacheScheme
    k_scales: list[Tensor] | None = None
    v_scales: list[Tensor] | None = None


def attention_shape(config) -> tuple[int, int, int]:
    """(layers, kv heads, head_dim) of the decoder's attention."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, heads, head_dim


def check_kv_model(model: nn.Module, spec: KVCacheScheme) -> None:
    """PtqError naming the layer and why, for a model whose attention the cache cannot serve."""
    config = model.config
    what = f"kv_cache {spec.scheme} {spec.strategy}"
    if getattr(config, "is_encoder_decoder", False):
        raise PtqError(f"{what}: {type(model).__name__} has cross attention (encoder-decoder), "
                       "which the quantized cache does not serve; remove kv_cache from the recipe")
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None) or []
    for index, kind in enumerate(layer_types):
        if kind != "full_attention":
            raise PtqError(f"{what}: layer {index} uses {kind}, which the quantized cache does not serve "
                           "(it holds every token of full-attention layers); remove kv_cache from the recipe")
    window = getattr(text, "sliding_window", None)
    if window is not None and getattr(text, "use_sliding_window", True) is not False:
        raise PtqError(f"{what}: the model's attention uses a sliding window of {window} tokens "
                       "(config sliding_window), which the quantized cache does not serve; remove kv_cache")
    blocks_path, blocks = find_blocks(model)
    for index, block in enumerate(blocks):
        if not any(hasattr(m, "layer_idx") and m is not block for m in block.modules()):
            raise PtqError(f"{what}: {blocks_path}.{index} has no attention with a cache (no layer_idx); "
                           "the quantized cache cannot serve this model")
    _, _, head_dim = attention_shape(config)
    if not spec.static:
        if head_dim % spec.group_size:
            raise PtqError(f"kv_cache group_size {spec.group_size} does not divide the model's head_dim {head_dim}; "
                           "choose a divisor of it")
        if head_dim * spec.bits % 8:
            raise PtqError(f"kv_cache {spec.scheme}: head_dim {head_dim} does not fill whole bytes")


class _RangeObserver:
    """Stands in for a Cache while blocks run: records max |x| per kv head of what
    `update` receives (keys after rotary embedding, values) and hands it back unchanged."""

    def __init__(self):
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        for seen, states in ((self.keys, key_states), (self.values, value_states)):
            peak = states.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
            seen[layer_idx] = peak if layer_idx not in seen else torch.maximum(seen[layer_idx], peak)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _cache_argument(block: nn.Module) -> str:
    parameters = inspect.signature(block.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise PtqError(f"{type(block).__name__}.forward takes no cache argument ({', '.join(CACHE_ARGUMENTS)}); "
                   "the quantized cache cannot serve this model")


@torch.no_grad()
def calibrate_kv(model: nn.Module, batches: Tensor, spec: KVCacheScheme, *, device: torch.device,
                 scale_dtype: torch.dtype, show_progress: bool = True, batch_size: int | None = None) -> KVState:
    """Static scales for every layer from the calibration batches (kivi: none needed), run
    batch_size samples at a time (runner.batch_size_for's by default)."""
    if not spec.static:
        return KVState(spec)
    observer = _RangeObserver()
    blocks_path, blocks = find_blocks(model)
    argument = _cache_argument(blocks[0])

    def observe(run: BlockRun) -> Inputs:
        outputs = []
        for args, kwargs in run.inputs:
            out = run.block(*args, **{**kwargs, argument: observer})
            hidden = out[0] if isinstance(out, tuple) else out
            outputs.append(((hidden, *args[1:]), kwargs) if args else ((), {**kwargs, "hidden_states": hidden}))
        return outputs

    run_blocks(model, blocks_path, batches, observe, device=device, batch_size=batch_size, show_progress=show_progress)
    layers, heads, _ = attention_shape(model.config)
    missing = [i for i in range(layers) if i not in observer.keys]
    if missing:
        raise PtqError(f"kv_cache: the attention of layer {missing[0]} never wrote to the cache during calibration; "
                       "the quantized cache cannot serve this model")
    # with several processes: the ranges of all their samples, in one message
    peaks = all_reduce_(torch.stack([torch.stack([observer.keys[i], observer.values[i]]) for i in range(layers)]),
                        "max")  # [layers, 2, kv heads]
    for i in range(layers):
        observer.keys[i], observer.values[i] = peaks[i, 0], peaks[i, 1]
    k_scales, v_scales = [], []
    for i in range(layers):
        for seen, scales in ((observer.keys, k_scales), (observer.values, v_scales)):
            peak = seen[i] if spec.strategy == "head" else seen[i].max().expand(heads)
            # stored in the checkpoint dtype: the scale used is the scale saved
            scales.append(quant.static_scale(peak, spec.kind).to(scale_dtype).float())
    return KVState(spec, k_scales, v_scales)
