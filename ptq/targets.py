"""Which modules a recipe step or a checkpoint config group means (compressed-tensors syntax)."""

from __future__ import annotations

import re

from torch import nn


def matches(name: str, module: nn.Module, patterns: list[str]) -> bool:
    """compressed-tensors target syntax: a class name, an exact module name, or 're:<regex>'."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name or pattern == type(module).__name__:
            return True
    return False
