"""What the calibration passes' compiled glue (ptq.cpu_norm, ptq.cpu_mlp) shares: knowing a
module by its class's forward being transformers' Llama code (bytecode, names and
constants: other families copy that code), seeing whether a call would run hooks, and
setting a compiled forward on module instances while a block's passes run."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn


def code_of(function) -> tuple | None:
    """What identifies a Python function's computation: its bytecode, names and constants."""
    code = getattr(function, "__code__", None)
    return None if code is None else (code.co_code, code.co_names, code.co_consts, code.co_varnames)


@functools.cache
def llama_code(class_name: str) -> tuple | None:
    """code_of transformers' modeling_llama.<class_name>.forward; None where this
    transformers has no such class."""
    try:
        from transformers.models.llama import modeling_llama
    except ImportError:
        return None
    cls = getattr(modeling_llama, class_name, None)
    return None if cls is None else code_of(cls.forward)


def runs_llama_code(module: nn.Module, class_name: str) -> bool:
    """Whether module's class computes as transformers' <class_name>.forward, and the
    instance has no forward of its own (accelerate's offloading sets one)."""
    reference = llama_code(class_name)
    return reference is not None and code_of(type(module).forward) == reference and "forward" not in vars(module)


def hooked(module: nn.Module) -> bool:
    """Whether calling module would run hooks (its own or global ones)."""
    hooks = nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or hooks._global_forward_hooks
                or hooks._global_forward_pre_hooks)


@contextmanager
def instance_forwards(forwards: list[tuple[nn.Module, Callable]]) -> Iterator[None]:
    """Each module's forward is the given function while inside (set on the instance, so
    that nn.Module.__call__ and its hooks still wrap it); the class's again after."""
    for module, forward in forwards:
        module.forward = forward
    try:
        yield
    finally:
        for module, _ in forwards:
            del module.forward
