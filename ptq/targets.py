"""Which modules a recipe step or a checkpoint config group means (compressed-tensors syntax).

Matching is compressed-tensors' own (`compressed_tensors.utils.match.is_match`), so ptq
and every reader of its checkpoints (transformers, vLLM) choose the same modules: a
class name matches the module's class or any class it derives from (`Linear` matches
Falcon's FalconLinear, an nn.Linear subclass), an exact module name, or 're:<regex>'
(re.match on the module name).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from compressed_tensors.utils.match import is_match
from torch import nn


def matches(name: str, module: nn.Module, patterns: Sequence[str]) -> bool:
    """Whether any pattern matches the module: its name exactly, 're:<regex>' on its name,
    or the name of its class or of a class it derives from.

    Recipes check their 're:' patterns on load (`pattern_problem`), so none is invalid here.
    """
    return bool(patterns) and is_match(name, module, list(patterns))


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
