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
