"""The attention function that reads a quantized cache's bytes on decoding steps.

Registered with transformers as ATTENTION ("ptq_kv"). A one-token step whose cache layer
handed itself over (QuantizedKVLayer with fused=True) runs ptq.kernels' decode-attention
kernel on the stored codes and merges it with attention over the 16-bit window; every
other call (prefill, a cache that returned dequantized states) is transformers' SDPA.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ptq.kv.cache import ATTENTION


def _key_mask(attention_mask: Tensor | None, length: int) -> Tensor | None:
    """[B, kv_len] bool (True = attend) from the model's [B, 1, 1, kv_len] mask (bool, or
    additive with -inf / the dtype's minimum), or None when every key is attended."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, 0, -1, -length:]
    return mask if mask.dtype == torch.bool else mask == 0


def _dense(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of q [B, Hq, D] over 16-bit k, v [B, H, T, D]: (out float32 [B, Hq, D], lse [B, Hq])."""
    batch, q_heads, dim = q.shape
    groups = q_heads // k.shape[1]
    qg = q.float().view(batch, k.shape[1], groups, dim)
    scores = torch.einsum("bhgd,bhtd->bhgt", qg, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhgt,bhtd->bhgd", weights, v.float())
    return out.reshape(batch, q_heads, dim), lse.reshape(batch, q_heads)


def ptq_kv_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layer = kwargs.pop("ptq_kv_layer", None)
    if layer is None or query.shape[2] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    from ptq.kernels.kv_attention import decode_attention, merge_attention

    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[:, :, 0, :]
    quantized = layer.quantized_length
    total = quantized + layer.keys.shape[-2]
    mask = _key_mask(attention_mask, total)
    window = _dense(q, layer.keys, layer.values, None if mask is None else mask[:, quantized:], scale)
    if quantized:
        stored = decode_attention(q, layer.storage(), None if mask is None else mask[:, :quantized].contiguous(), scale)
        out, lse = merge_attention(*stored, *window) if layer.keys.shape[-2] else stored
    else:
        out, lse = window
    return out.to(query.dtype).unsqueeze(1), None  # [B, 1, Hq, D], as transformers' attention returns


def register() -> None:
    """Make ATTENTION known to transformers (attention and mask functions); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, ptq_kv_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
