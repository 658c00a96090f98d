"""Which modules a recipe step or a checkpoint config group means (compressed-tensors syntax)."""

from __future__ import annotations

import re

from torch import nn


def matches(name: str, module: nn.Module, patterns: list[str]) -> bool:
    """compressed-tensors target syntax: a class name, an exact module name, or 're:<regex>'.

    Recipes check their 're:' patterns on load (`pattern_problem`), so none is invalid here.
    """
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif pattern == name or pattern == type(module).__name__:
            return True
    return False


def pattern_problem(pattern: str) -> str | None:
    """Why a target pattern cannot be used (an 're:' regex that does not compile), or None."""
    if not pattern.startswith("re:"):
        return None
    shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
    try:
        re.compile(pattern[3:])
    except re.error as error:
        return f"invalid regex '{shown}': {error}"
    except (RecursionError, OverflowError):  # nested or repeated beyond what re can compile
        return f"invalid regex '{shown}': too deeply nested or too large a repetition"
    return None
