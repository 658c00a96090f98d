"""Model variants for measuring outlier handling.

Small models trained briefly have few activation outliers; large LLMs have a handful of
channels with activations tens of times larger than the rest, which is what SmoothQuant
and AWQ are for. `inject_outliers_` gives a model such channels without changing its
function: a few output channels of each norm feeding Linears are multiplied by `factor`,
and the matching input columns of those Linears divided by it.
"""

from __future__ import annotations

import torch
from torch import nn

from ptq.algorithms.smoothquant import apply_smoothing_
from ptq.arch import block_mappings, find_blocks


@torch.no_grad()
def inject_outliers_(model: nn.Module, *, channels: int = 4, factor: float = 50.0, seed: int = 0) -> list[str]:
    """Make `channels` random channels after each smoothable norm `factor` times larger, in
    place and function-preserving in full precision; returns the norms changed."""
    generator = torch.Generator().manual_seed(seed)
    _, blocks = find_blocks(model)
    changed = []
    for index, block in enumerate(blocks):
        mappings, _ = block_mappings(model, block)
        for m in mappings:
            if isinstance(m.smooth, nn.Linear):
                continue  # only norms: their outputs are what the next Linears read
            chosen = torch.randperm(m.channels, generator=generator)[:channels]
            scales = torch.ones(m.channels)
            scales[chosen] = 1.0 / factor  # the norm is divided by scales: multiplied by factor
            apply_smoothing_(m.smooth, m.balance, scales.to(m.balance[0].weight.device),
                             weight_offset=m.weight_offset)
            changed.append(f"{index}.{m.mapping.smooth}")
    return changed


@torch.no_grad()
def inject_key_outlier_(model: nn.Module, *, factor: float = 30.0, kv_head: int = 0, channel: int = 0) -> list[str]:
    """Make one key channel of one key/value head `factor` times larger in every layer, in
    place and function-preserving in full precision: the rows of k_proj that produce channel
    `channel` and its rotary partner (channel + head_dim/2; rotary embedding mixes the two,
    so both are scaled alike) are multiplied by factor, and the same rows of q_proj of every
    query head reading that kv head divided by it, so that q·k is unchanged. Large language
    models have such key channels; they are why KIVI quantizes keys per channel and why
    per-head cache scales beat one scale per layer. Returns the k_proj modules changed."""
    from ptq.kv.calibrate import attention_shape

    _, kv_heads, head_dim = attention_shape(model.config)
    text = model.config.get_text_config(decoder=True)
    group = text.num_attention_heads // kv_heads
    pair = [channel % (head_dim // 2), channel % (head_dim // 2) + head_dim // 2]
    changed = []
    for name, module in model.named_modules():
        if not (hasattr(module, "k_proj") and hasattr(module, "q_proj")):
            continue
        k_rows = [kv_head * head_dim + c for c in pair]
        q_rows = [(kv_head * group + g) * head_dim + c for g in range(group) for c in pair]
        module.k_proj.weight[k_rows] *= factor
        module.q_proj.weight[q_rows] /= factor
        for proj, rows, by in ((module.k_proj, k_rows, factor), (module.q_proj, q_rows, 1 / factor)):
            if getattr(proj, "bias", None) is not None:
                proj.bias[rows] *= by
        changed.append(f"{name}.k_proj")
    return changed
